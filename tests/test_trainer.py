"""grpo/train/trainer.py end to end on a tiny config: SFT then GRPO, resume after a kill, NaN, 2 processes (the
loop's wiring: tests/test_trainer_loop.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grpo import paths
from grpo.cli import main
from grpo.config import load_config
from grpo.data.jsonl import read_records
from grpo.data.select import train_records
from grpo.health.metrics import HEALTH_METRICS
from grpo.provenance.lineage import is_stale
from grpo.train import checkpoint as ckpt
from grpo.train import trainer
from tests.tiny_project import copy_prepared as copy_project
from tests.tiny_project import prepared_project, run_stages

pytestmark = pytest.mark.slow
GRPO = str(Path(sys.executable).with_name("grpo"))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """Data, base, SFT and pre-flight once for the module; each test copies it."""
    return prepared_project(tmp_path_factory.mktemp("tiny"))


def adapter_weights(params: Path) -> dict[str, torch.Tensor]:
    return load_file(str(params.parent / "models" / "grpo" / "adapter_model.safetensors"))


def test_sft_then_train_end_to_end(project, tmp_path):
    params = copy_project(project, tmp_path / "p")
    cfg = load_config(params)
    assert main(["train", "--params", str(params), "--max-steps", "10"]) == 0  # never past grpo.steps (4)
    run_dir = Path(cfg.paths.runs_dir) / cfg.experiment
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    missing = [name for name in HEALTH_METRICS if any(name not in line for line in lines)]
    assert missing == []
    history = json.loads((run_dir / "entropy_history_tiny.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(h["entropy"] > 0 for h in history)
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs and b"policy/entropy" in runs[0].read_bytes()
    # The LoRA B matrices start at zero: a trained adapter has moved them.
    weights = adapter_weights(params)
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)
    summary = json.loads((Path(cfg.paths.metrics_dir) / "grpo.json").read_text())
    assert summary["steps"] == 4
    # models/grpo records the lineage that lets evaluation (and a later run) trust it
    assert is_stale(paths.model_dir(cfg, "grpo"), "grpo", cfg, paths.stage_inputs(cfg, "grpo")) is None


def test_i9_the_trainers_first_step_has_ratio_1_and_kl_0(project, tmp_path):
    """The trainer's own step (its context, reference and optimizer, as `grpo train` wires them): at its
    first step the policy is its reference, so every token's ratio is 1 and its KL 0, and no ratio clips."""
    params = copy_project(project, tmp_path / "p")
    cfg = load_config(params)
    assert cfg.grpo.loss.beta > 0
    assert main(["train", "--params", str(params), "--max-steps", "1"]) == 0
    first = json.loads((Path(cfg.paths.runs_dir) / cfg.experiment / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["kl"] <= 1e-9 and first["ratio/mean"] == pytest.approx(1.0, abs=1e-7)
    assert first["clip_ratio/region_mean"] == 0.0


def test_i9_training_refuses_a_wrong_reference_wired_after_construction(project, tmp_path, monkeypatch):
    """A reference swapped into the built step after ``build_training`` (the pre-SFT base): no gate runs that
    wiring, so the trainer's own first-step check stops step 1 before its update, naming I9, and nothing is
    trained, checkpointed or logged."""
    from grpo.model.stage_models import load_base
    from grpo.train.agreement import StepInvariantError

    params = copy_project(project, tmp_path / "p")
    cfg = load_config(params)
    built = trainer.build_training

    def swapped(cfg, accelerator, shard=None):
        step = built(cfg, accelerator, shard=shard)
        return dataclasses.replace(step, reference=load_base(cfg)[0].eval())

    monkeypatch.setattr(trainer, "build_training", swapped)
    with pytest.raises(StepInvariantError, match=r"step 1 stopped before its update: .*KL .*\(I9\)") as caught:
        trainer.train(cfg, max_steps=2, progress=False)
    assert caught.value.invariant == "I9"
    run_dir = paths.run_dir(cfg)
    assert not list(run_dir.glob("checkpoint-*")), "no checkpoint of a step that never updated"
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "no step was logged"


def _train_process(params: Path, *extra: str) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([GRPO, "train", "--params", str(params), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_resume_after_kill_ends_with_the_same_weights(project, tmp_path):
    straight = copy_project(project, tmp_path / "straight")
    run_stages(straight, "train")
    killed = copy_project(project, tmp_path / "killed")
    run_dir = killed.parent / "runs" / "tiny"
    proc = _train_process(killed)
    deadline = time.monotonic() + 120
    while not list(run_dir.glob("checkpoint-*/state.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # a real kill, mid-run, not an exception
    proc.wait()
    assert not (killed.parent / "models" / "grpo").exists(), "the run finished before it was killed"
    resumed = _train_process(killed)
    output = resumed.communicate(timeout=300)[0].decode()
    assert resumed.returncode == 0, output
    assert "resuming from" in output
    a, b = adapter_weights(straight), adapter_weights(killed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_resume_refuses_a_checkpoint_of_other_params_or_code_and_starts_fresh(project, tmp_path, capsys,
                                                                             monkeypatch):
    """The newest checkpoint is resumed only by the code, params and inputs that wrote it: another loss
    setting, or a module changed since (here: ``core/losses.py`` hashes otherwise than when the checkpoints
    were written, as after a fix), starts fresh and says why, naming what changed."""
    from grpo.model.device import make_accelerator
    from grpo.provenance import lineage as lineage_module
    from grpo.train.policy import build_policy

    params = copy_project(project, tmp_path / "p")
    run_stages(params, "train")
    cfg = load_config(params)
    policy = build_policy(cfg, make_accelerator().device)
    start, history = trainer.resume(cfg, policy)
    assert start == 4 and [h["step"] for h in history] == [1, 2, 3, 4]
    assert trainer.resume(load_config(params, ["checkpoint.resume=false"]), policy) == (0, [])  # asked to start over

    assert trainer.resume(load_config(params, ["grpo.loss.beta=0.5"]), policy) == (0, [])
    said = capsys.readouterr().out
    assert "not resuming from" in said and "checkpoint-00000004" in said and "grpo.loss.beta" in said

    fingerprint = lineage_module.stage_fingerprint

    def after_a_fix(stage, root=None):  # the code now differs from what wrote the checkpoints in one module
        current = fingerprint(stage, root)
        current["modules"] = {m: "0" * 64 if m.endswith("core/losses.py") else h
                              for m, h in current["modules"].items()}
        return current

    monkeypatch.setattr(lineage_module, "stage_fingerprint", after_a_fix)
    assert trainer.resume(cfg, policy) == (0, [])
    said = capsys.readouterr().out
    module = "grpo/core/losses.py"
    assert "not resuming from" in said and f"{module} changed since" in said


def test_half_written_checkpoint_is_never_loaded(project, tmp_path):
    params = copy_project(project, tmp_path / "p")
    run_stages(params, "train")
    run_dir = params.parent / "runs" / "tiny"
    # A kill during save: a newer checkpoint directory whose completion marker was never written.
    shutil.copytree(run_dir / "checkpoint-00000004", run_dir / "checkpoint-00000009")
    (run_dir / "checkpoint-00000009" / "state.json").unlink()
    from grpo.train.checkpoint import latest_checkpoint

    assert latest_checkpoint(run_dir).name == "checkpoint-00000004"


def test_nan_loss_stops_with_a_clear_error_and_saves_nothing(project, tmp_path, monkeypatch):
    """A reward function that returns NaN (a user's buggy reward) poisons the loss of its task."""
    from grpo.errors import GrpoError
    from grpo.rewards import REWARDS
    from grpo.train.trainer import train

    params = copy_project(project, tmp_path / "p")
    monkeypatch.setitem(REWARDS, "hallucination", lambda completion, example, *extra: float("nan"))
    with pytest.raises(GrpoError, match="NaN/Inf") as err:
        train(load_config(params), progress=False)
    assert "hallucination" in str(err.value)
    assert not list((params.parent / "runs" / "tiny").glob("checkpoint-*"))
    assert not (params.parent / "models" / "grpo").exists()


def test_two_processes_end_with_identical_weights(project, tmp_path):
    """CAGrad on 2 CPU processes: per-task gradients are all-reduced before the (nonlinear)
    combination, so both processes take the same step; the trainer compares weight digests."""
    params = copy_project(project, tmp_path / "p")
    overrides = ["--set", "grpo.multitask.mode=cagrad",
                 # The entropy term has a gradient even when every group's rewards tie (likely on the tiny
                 # model), so the weights move whatever the rollouts drew.
                 "--set", "grpo.loss.entropy_coef=0.01"]
    assert main(["preflight", "--params", str(params), *overrides]) == 0  # the gate checks the same loss
    # `accelerate launch --cpu` starts several CPU processes only through mpirun (absent here);
    # torchrun sets the same distributed environment, which Accelerator picks up (gloo on CPU).
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "grpo.cli", "train", "--params", str(params),
         "--set", "grpo.steps=2", *overrides],
        capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((params.parent / "metrics" / "grpo.json").read_text())
    digests = summary["process_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    weights = adapter_weights(params)
    assert any(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)
    # Only the main process writes: one metrics line per step, one W&B run.
    run_dir = params.parent / "runs" / "tiny"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


def test_lora_off_trains_every_weight_against_the_frozen_sft_model(project, tmp_path):
    """``model.lora.enabled: false``: GRPO fine-tunes all weights, and the KL reference stays the SFT
    weights (a frozen copy, I9) while the policy moves away from them over two steps."""
    from grpo.core.logprobs import score_completions
    from grpo.data.jsonl import read_records
    from grpo.model.device import make_accelerator
    from grpo.model.stage_models import load_sft
    from grpo.train.policy import build_policy
    from grpo.train.step import build_step, draw, grpo_step, prepare_batch

    params = copy_project(project, tmp_path / "p")
    tree = yaml.safe_load(params.read_text())
    tree["model"]["lora"]["enabled"] = False
    tree["grpo"] |= {"steps": 2, "loss": {"beta": 0.1}}
    params.write_text(yaml.safe_dump(tree, sort_keys=False))
    cfg = load_config(params)
    assert not cfg.model.lora.enabled and cfg.grpo.loss.beta == 0.1
    run_stages(params, "sft")  # model.* is part of the SFT lineage: rebuilt under these params
    sft, _ = load_sft(cfg)
    accelerator = make_accelerator()
    policy = build_policy(cfg, accelerator.device)
    assert not any("lora" in name for name, _ in policy.model.named_parameters())
    assert all(p.requires_grad for p in policy.model.parameters())
    assert policy.reference is not None and not any(p.requires_grad for p in policy.reference.parameters())
    step = build_step(cfg, policy, accelerator)
    records = read_records(params.parent / "data" / "processed" / "train.jsonl")[:4]
    for index in (1, 2):
        grpo_step(step, records, index, lambda attempt: records)
    sft_weights = dict(sft.named_parameters())
    assert any(not torch.equal(p, sft_weights[n]) for n, p in policy.model.named_parameters()), "policy did not move"
    assert all(torch.equal(p, sft_weights[n]) for n, p in policy.reference.named_parameters())
    batch = prepare_batch(step, draw(step, records, seed=3))
    width, mask = batch.completion_mask.shape[1], batch.completion_mask
    with torch.no_grad():
        expected = score_completions(sft, batch.inputs.input_ids, batch.inputs.attention_mask, width, 1.0).logprobs
        moved = score_completions(policy.model, batch.inputs.input_ids, batch.inputs.attention_mask, width, 1.0).logprobs
    torch.testing.assert_close(batch.ref_logprobs[mask], expected[mask], rtol=0, atol=1e-5)
    assert (moved[mask] - expected[mask]).abs().max() > 1e-4, "the reference would equal the moving policy"


def test_grpo_holdout_keeps_grpo_prompts_out_of_sft(tmp_path, monkeypatch):
    """With ``data.grpo_holdout`` the SFT stage trains on one part of the train records and the GRPO
    stage samples every prompt from the other: the stage code paths, not the selection helper alone."""
    params = prepared_project(tmp_path / "p", data={"grpo_holdout": 0.5})
    cfg = load_config(params)
    held_out = {r["id"] for r in train_records(cfg, "grpo")}
    everything = read_records(paths.data_file(cfg, "train"))
    sft_summary = json.loads(paths.metrics_file(cfg, "sft").read_text())
    assert 0 < len(held_out) < len(everything)
    assert sft_summary["examples"] == len(everything) - len(held_out)
    prompted = []
    real_step = trainer.grpo_step

    def spy(context, records, *args, **kwargs):
        prompted.extend(record["id"] for record in records)
        return real_step(context, records, *args, **kwargs)

    monkeypatch.setattr(trainer, "grpo_step", spy)
    run_stages(params, "train")
    assert len(prompted) == cfg.grpo.steps * cfg.grpo.prompts_per_step
    assert set(prompted) <= held_out


def test_an_offline_run_opens_no_socket_and_max_steps_says_what_it_wrote(project, tmp_path):
    """`grpo train --max-steps 1` as a user runs it (tracking.wandb: offline from params, no WANDB_* in
    the environment): the W&B run is written and no process of it (Python or W&B's Go service) looks up
    or connects to any host; the last line says that a checkpoint, not a policy, was written."""
    from tests.network_trace import traced

    params = copy_project(project, tmp_path / "p")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"PYTHONUNBUFFERED": "1"}
    # checkpoint.every 3: step 1, where --max-steps stops the run, is off the cadence and still saved
    command = [GRPO, "train", "--params", str(params), "--max-steps", "1", "--set", "checkpoint.every=3"]
    done, reached = traced(command, tmp_path / "trace.log", env=env, capture_output=True, text=True, timeout=600,
                           cwd=params.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = params.parent / "runs" / "tiny"
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run written"
    assert reached == [], "network attempts of an offline training run:\n" + "\n".join(reached)
    assert "policy in" not in done.stdout and not (params.parent / "models" / "grpo").exists()
    assert ckpt.is_complete(run_dir / "checkpoint-00000001")
    assert ("grpo: 1 new step in " in done.stdout and f"no policy written yet: step 1 of grpo.steps=4 is a "
            f"checkpoint in {run_dir}, from which `grpo train` continues" in done.stdout), done.stdout[-2000:]


def test_a_killed_run_resumes_with_every_step_once_even_when_its_metrics_lost_lines(project, tmp_path):
    """SIGKILL after the checkpoint of step 4, then the metrics file loses lines (as when a second writer
    rewrote it): the resume cuts the file only after step 4, writes steps 2-4 back from the checkpoint
    exactly as the run first wrote them, and the finished run has every step once; its summary counts
    only the new steps."""
    params = copy_project(project, tmp_path / "p")
    overrides = ("--set", "grpo.steps=6", "--set", "checkpoint.every=2")
    run_dir = params.parent / "runs" / "tiny"
    proc = _train_process(params, *overrides)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoint-00000004" / "state.json").is_file() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint of step 4 appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (params.parent / "models" / "grpo").exists(), "the run finished before it was killed"
    metrics = run_dir / "metrics.jsonl"
    written = metrics.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in written[:4]] == [1, 2, 3, 4]
    metrics.write_text(written[0])
    resumed = _train_process(params, *overrides)
    output = resumed.communicate(timeout=600)[0].decode()
    assert resumed.returncode == 0, output
    lines = metrics.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[:4] == written[:4]
    entropy = json.loads((run_dir / "entropy_history_tiny.json").read_text())
    assert [h["step"] for h in entropy] == [1, 2, 3, 4, 5, 6]
    assert "grpo: 2 new steps after 4 restored from its checkpoint in " in output, output[-2000:]
    assert f"policy in {params.parent / 'models' / 'grpo'}" in output


