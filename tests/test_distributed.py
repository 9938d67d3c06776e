"""Several processes train like one, end to end: the sharding (grpo/train/task_mix.py), the step's global
totals and all-reduce (grpo/train/step.py), the merged metrics (grpo/health/metrics.py), stopping together.

The end-to-end tests start ``tests/distributed_run.py`` under torchrun (gloo on CPU), the same way
``tests/test_trainer.py`` starts the trainer on two processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.core.advantages import group_advantages
from tests.distributed_run import CONFIGS, FSDP_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
pytestmark = pytest.mark.slow
PER_PROCESS = ("step_time", "tokens_per_s")  # wall-clock figures: not a property of the batch


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tests/distributed_run.py`` on ``nproc`` processes; on timeout the whole process group is
    killed (torchrun's workers too) and TimeoutExpired raised."""
    process = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m", "tests.distributed_run", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int | str, Path]:
    """Every configuration trained on 1 and on 2 processes on the same global batches; ``"fsdp"``: those
    of FSDP_CONFIGS on 2 processes with the policy sharded by FSDP2."""
    out = {}
    for key, nproc, scenario in ((1, 1, "equal"), (2, 2, "equal"), ("fsdp", 2, "equal_fsdp")):
        out[key] = tmp_path_factory.mktemp(f"run-{key}")
        done = torchrun(nproc, scenario, str(out[key]))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_train_like_one(runs, name):
    """After 3 SGD steps the weights moved and equal the one-process weights to fp32 tolerance, and
    the logged metrics (rewards, lengths, losses, entropy, KL, gradient norms) are the global batch's."""
    assert_same_training(runs[1], runs[2], name)


@pytest.mark.parametrize("name", FSDP_CONFIGS)
def test_two_fsdp_processes_train_like_one_unsharded(runs, name):
    """The policy sharded by FSDP2 on 2 processes (each holds a shard of every task gradient; CAGrad's
    and PCGrad's dot products and the clipping norm are summed over shards) ends where one unsharded
    process ends, with the same metrics."""
    assert_same_training(runs[1], runs["fsdp"], name)


def test_clipping_bites_in_the_clipped_configuration(runs):
    """``cagrad_clipped`` tests the clipping only if a gradient norm exceeds its max_grad_norm."""
    norms = [step["grad_norm"] for step in json.loads((runs[1] / "cagrad_clipped.json").read_text())]
    assert max(norms) > CONFIGS["cagrad_clipped"][2]["max_grad_norm"], norms


def assert_same_training(dir_one: Path, dir_two: Path, name: str) -> None:
    one, two = (load_file(str(d / f"{name}.safetensors")) for d in (dir_one, dir_two))
    assert one.keys() == two.keys()
    assert json.loads((dir_one / f"{name}.json").read_text())[-1]["max_update"] > 1e-3, "training did not move"
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    logs = [json.loads((d / f"{name}.json").read_text()) for d in (dir_one, dir_two)]
    for step_one, step_two in zip(*logs, strict=True):
        assert step_one.keys() == step_two.keys()
        for key in step_one.keys() - set(PER_PROCESS):
            torch.testing.assert_close(torch.tensor(step_two[key], dtype=torch.float64),
                                       torch.tensor(step_one[key], dtype=torch.float64),
                                       rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


# --------------------------------------------------------------------------- stopping together


@pytest.mark.parametrize(("scenario", "word"), [("monitor", "STOPPED"), ("nan", "RAISED")])
def test_a_stop_on_one_process_stops_every_process(scenario, word):
    """Process 1 alone has a completion with a chat header (or a NaN reward); both processes stop,
    neither waits for the other in an all-reduce (the timeout turns such a hang into a failure)."""
    try:
        done = torchrun(2, scenario, timeout=180)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"the processes hung: one stopped while the other waited in an all-reduce\n{hang.stdout}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert f"rank 0 {word}" in output and f"rank 1 {word}" in output, output[-3000:]
    assert "CONTINUED" not in output


# --------------------------------------------------------------------------- batch-scaled advantages


def test_batch_scaling_divides_by_the_global_batch_std(tmp_path):
    """``scale_rewards: batch`` on 2 processes: each process's advantages are those one process holding
    both processes' groups computes (the std of all rewards), and differ from each process's own std."""
    done = torchrun(2, "batch_std", str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [load_file(str(tmp_path / f"rank{rank}.safetensors")) for rank in (0, 1)]
    whole, _ = group_advantages(torch.cat([r["rewards"] for r in ranks]), 4, "batch")
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), whole)
    local = torch.cat([r["local"] for r in ranks])
    assert not torch.allclose(local, whole), "the processes' own stds equal the global one: nothing tested"
    # The step's own path: draw() on each process's 2 and 3 prompts (4 completions each).
    drawn, _ = group_advantages(torch.cat([r["draw_rewards"] for r in ranks]), 4, "batch")
    own = torch.cat([group_advantages(r["draw_rewards"], 4, "batch")[0] for r in ranks])
    assert not torch.allclose(own, drawn), "the processes' own stds equal the global one: nothing tested"
    torch.testing.assert_close(torch.cat([r["draw_advantages"] for r in ranks]), drawn)
