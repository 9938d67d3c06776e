"""Several processes train like one: grpo/train/task_mix.py sharding, the step's global totals and
all-reduce (grpo/train/step.py), the merged metrics (grpo/health/metrics.py) and stopping together.

The end-to-end tests start ``tests/distributed_run.py`` under torchrun (gloo on CPU), the same way
``tests/test_trainer.py`` starts the trainer on two processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.errors import GrpoError
from grpo.health.metrics import merge_process_metrics
from grpo.train.task_mix import sample_step, shard, shard_indices
from tests.distributed_run import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PER_PROCESS = ("step_time", "tokens_per_s")  # wall-clock figures: not a property of the batch


# --------------------------------------------------------------------------- sharding


@pytest.mark.parametrize(("tasks", "processes", "expected"), [
    ("fhfhfhfh", 2, ["fhfh", "fhfh"]),  # a plain stride gives ffff / hhhh
    ("fhfhfh", 2, ["fhf", "hfh"]),
    ("fhfhfhff", 2, ["fhff", "hfhf"]),  # fairness_fraction 0.625: 3+1 and 2+2
    ("fhfhff", 4, ["fh", "fh", "f", "f"]),
])
def test_every_process_holds_its_share_of_each_task(tasks, processes, expected):
    shards = [shard_indices(list(tasks), p, processes) for p in range(processes)]
    assert ["".join(tasks[i] for i in s) for s in shards] == expected
    assert sorted(i for s in shards for i in s) == list(range(len(tasks)))  # a partition, in order
    for task in set(tasks):
        counts = [sum(tasks[i] == task for i in s) for s in shards]
        assert max(counts) - min(counts) <= 1


def test_shard_of_a_sampled_step_keeps_both_tasks():
    by_task = {"fairness": [{"task": "fairness", "id": i} for i in range(5)],
               "hallucination": [{"task": "hallucination", "id": i} for i in range(5)]}
    records = sample_step(by_task, 8, 0.5, seed=0, step=1)
    for process in range(2):
        assert {r["task"] for r in shard(records, process, 2)} == {"fairness", "hallucination"}


def test_more_processes_than_prompts_is_an_error_naming_the_param():
    with pytest.raises(GrpoError, match=r"grpo.prompts_per_step >= 4"):
        shard_indices(["fairness", "hallucination"], 0, 4)


# --------------------------------------------------------------------------- merged metrics


def test_merged_metrics_are_those_of_the_concatenated_rows():
    """Two processes' reward and length statistics merge into the statistics of all rows together."""
    rewards = [torch.tensor([0.1, 0.2, 0.7, 0.7]), torch.tensor([1.0, 0.0])]  # one task per process here
    lengths = [torch.tensor([3.0, 5.0, 8.0, 2.0]), torch.tensor([4.0, 9.0])]
    per_process = [{"rewards/fairness/mean": float(r.mean()), "rewards/fairness/std": float(r.std(correction=0)),
                    "completions/mean_length": float(n.mean()), "completions/min_length": float(n.min()),
                    "completions/max_length": float(n.max()), "step_time": t, "tokens_per_s": float(n.sum()) / t,
                    "grad_norm": 0.5} for r, n, t in zip(rewards, lengths, (2.0, 4.0), strict=True)]
    counts = [{"rows": 4.0, "rows/fairness": 4.0}, {"rows": 2.0, "rows/fairness": 2.0}]
    merged = merge_process_metrics(per_process, counts)
    every_reward, every_length = torch.cat(rewards), torch.cat(lengths)
    assert math.isclose(merged["rewards/fairness/mean"], float(every_reward.mean()), rel_tol=1e-6)
    assert math.isclose(merged["rewards/fairness/std"], float(every_reward.std(correction=0)), rel_tol=1e-6)
    assert math.isclose(merged["completions/mean_length"], float(every_length.mean()), rel_tol=1e-6)
    assert (merged["completions/min_length"], merged["completions/max_length"]) == (2.0, 9.0)
    assert merged["step_time"] == 4.0 and math.isclose(merged["tokens_per_s"], 31.0 / 4.0)
    assert merged["grad_norm"] == 0.5  # computed from all-reduced gradients: the same everywhere


# --------------------------------------------------------------------------- 2 processes vs 1


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
def runs(tmp_path_factory) -> dict[int, Path]:
    """Every configuration trained on 1 and on 2 processes on the same global batches."""
    out = {}
    for nproc in (1, 2):
        out[nproc] = tmp_path_factory.mktemp(f"nproc{nproc}")
        done = torchrun(nproc, "equal", str(out[nproc]))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_train_like_one(runs, name):
    """After 3 SGD steps the weights moved and equal the one-process weights to fp32 tolerance, and
    the logged metrics (rewards, lengths, losses, entropy, KL, gradient norms) are the global batch's."""
    one, two = (load_file(str(runs[n] / f"{name}.safetensors")) for n in (1, 2))
    assert one.keys() == two.keys()
    assert any(t.abs().max() > 1e-3 for k, t in one.items() if "lora_B" in k), "training did not move"
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    logs = [json.loads((runs[n] / f"{name}.json").read_text()) for n in (1, 2)]
    for step_one, step_two in zip(*logs, strict=True):
        assert step_one.keys() == step_two.keys()
        for key in step_one.keys() - set(PER_PROCESS):
            torch.testing.assert_close(torch.tensor(step_two[key], dtype=torch.float64),
                                       torch.tensor(step_one[key], dtype=torch.float64),
                                       rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


# --------------------------------------------------------------------------- stopping together


@pytest.mark.slow
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
