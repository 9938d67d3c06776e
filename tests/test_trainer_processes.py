"""The GRPO trainer on several processes, end to end through ``grpo train`` under torchrun (gloo on CPU):
FSDP2 sharding of the policy (grpo/train/sharding.py) and checkpoints across process counts
(grpo/train/checkpoint.py).

``accelerate launch --cpu`` starts several CPU processes only through mpirun (absent here); torchrun
sets the same distributed environment, and ``ACCELERATE_USE_FSDP=true`` is what ``accelerate launch
--config_file configs/accelerate/fsdp.yaml`` puts in the processes' environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_trainer import copy_project
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MODES = {"replicated": {}, "fsdp": {"ACCELERATE_USE_FSDP": "true"}}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The tiny project with an entropy bonus: its gradient moves the weights even when every group's
    rewards tie (likely on the tiny model), so equal weights at the end mean something."""
    return prepared_project(tmp_path_factory.mktemp("tiny"), grpo={"loss": {"entropy_coef": 0.01}})


def train_process(params: Path, nproc: int, mode: str, *extra: str) -> subprocess.Popen:
    """``grpo train`` on ``nproc`` processes in its own process group (so a kill reaches every worker)."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)} | MODES[mode]
    return subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m", "grpo.cli", "train", "--params",
         str(params), *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)


def train(params: Path, nproc: int, mode: str, *extra: str) -> str:
    process = train_process(params, nproc, mode, *extra)
    try:
        output = process.communicate(timeout=300)[0].decode()
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, failure_report(output)
    return output


CAUSES = ("Error", "error:", "terminate called", "Abort", "abort", "Signal", "Killed")


def failure_report(output: str) -> str:
    """What a failed run printed about its cause: the lines that name an error, from every rank (the rank
    that died first is often not the one whose traceback fills the end), then the tail."""
    causes = [line for line in output.splitlines() if any(word in line for word in CAUSES)]
    return "\n".join(causes[-40:]) + "\n--- the end of the output ---\n" + output[-3000:]


def run_dir(params: Path) -> Path:
    return params.parent / "runs" / "tiny"


def adapter(params: Path) -> dict[str, torch.Tensor]:
    return load_file(str(params.parent / "models" / "grpo" / "adapter_model.safetensors"))


def steps_logged(params: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir(params) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(project, tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted 4-step run on 2 processes, replicated and FSDP-sharded."""
    out = {}
    for mode in MODES:
        out[mode] = copy_project(project, tmp_path_factory.mktemp(f"straight-{mode}") / "p")
        train(out[mode], 2, mode)
    return out


def test_fsdp_training_ends_where_replicated_training_ends(straight):
    """The same seeds and prompts on 2 processes: the FSDP2-sharded policy (shards of every task
    gradient, CAGrad on dot products summed over shards, clipping on the global norm) ends with the
    replicated run's adapter, and its checkpoints hold the same whole tensors in the same format."""
    replicated, fsdp = adapter(straight["replicated"]), adapter(straight["fsdp"])
    assert replicated.keys() == fsdp.keys()
    assert any(t.abs().max() > 1e-4 for k, t in replicated.items() if "lora_B" in k), "training did not move"
    for key in replicated:
        torch.testing.assert_close(fsdp[key], replicated[key], rtol=1e-4, atol=1e-6)
    last = [run_dir(straight[mode]) / "checkpoint-00000004" for mode in MODES]
    optimizers = [torch.load(path / "optimizer.pt", weights_only=True) for path in last]
    assert optimizers[0]["param_groups"] == optimizers[1]["param_groups"]
    for index, state in optimizers[0]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(optimizers[1]["state"][index][name], value, rtol=1e-4, atol=1e-8)
    summary = json.loads((straight["fsdp"].parent / "metrics" / "grpo.json").read_text())
    assert summary["steps"] == 4 and len(set(summary["process_weight_digests"])) == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_after_a_kill_on_two_processes_is_bit_exact(project, straight, tmp_path, mode):
    """Both processes SIGKILLed (the whole process group) after a checkpoint, then resumed on 2
    processes: the final adapter is bit-equal to the uninterrupted run's."""
    params = copy_project(project, tmp_path / "killed")
    process = train_process(params, 2, mode)
    deadline = time.monotonic() + 180
    while not list(run_dir(params).glob("checkpoint-*/state.json")) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (params.parent / "models" / "grpo").exists(), "the run finished before it was killed"
    assert "resuming from" in train(params, 2, mode)
    want, got = adapter(straight[mode]), adapter(params)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), "the resumed run's weights differ"
    assert steps_logged(params) == [1, 2, 3, 4]


CROSSINGS = [(2, "replicated", 1, "replicated"), (1, "replicated", 2, "fsdp"), (2, "fsdp", 1, "replicated")]


@pytest.mark.parametrize(("n_save", "save_mode", "n_load", "load_mode"), CROSSINGS)
def test_a_checkpoint_resumes_on_another_number_of_processes(project, tmp_path, n_save, save_mode, n_load,
                                                             load_mode):
    """A checkpoint written at step 2 by ``n_save`` processes is loaded by ``n_load``: the weights,
    optimizer state, scheduler, step and metric history the resumed run starts from are bit-equal to
    the saved ones (gathered back from the shards under FSDP), and training runs to the end."""
    params = copy_project(project, tmp_path / "p")
    train(params, n_save, save_mode, "--max-steps", "2")
    saved = run_dir(params) / "checkpoint-00000002"
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    done = resume_state(n_load, load_mode, params, loaded)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = json.loads((loaded / "resumed.json").read_text())
    assert resumed["processes"] == n_load and resumed["sharded"] == (load_mode == "fsdp")
    assert resumed["step"] == 2
    assert resumed["history"] == json.loads((saved / "history.json").read_text())
    want, got = load_file(str(saved / "model.safetensors")), load_file(str(loaded / "weights.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert_same_state(torch.load(saved / "optimizer.pt", weights_only=True),
                      torch.load(loaded / "optimizer.pt", weights_only=True))
    assert torch.load(saved / "scheduler.pt", weights_only=True) == torch.load(loaded / "scheduler.pt",
                                                                              weights_only=True)
    assert "resuming from" in train(params, n_load, load_mode)
    assert steps_logged(params) == [1, 2, 3, 4]
    assert json.loads((params.parent / "metrics" / "grpo.json").read_text())["steps"] == 4


def resume_state(nproc: int, mode: str, params: Path, out: Path) -> subprocess.CompletedProcess:
    """``tests/distributed_run.py resume_state``: what a run resumed on ``nproc`` processes starts from."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | MODES[mode]
    return subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m", "tests.distributed_run",
                           "resume_state", str(params), str(out)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


def assert_same_state(want: dict, got: dict) -> None:
    """Optimizer state dicts equal bit for bit (tensors) and by value (everything else)."""
    assert want["param_groups"] == got["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for index, state in want["state"].items():
        assert state.keys() == got["state"][index].keys()
        assert all(torch.equal(value, got["state"][index][name]) for name, value in state.items()), index

