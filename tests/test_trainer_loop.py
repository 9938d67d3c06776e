"""grpo/train/trainer.py's loop, in process on the tiny project (slow): the gate before anything is written,
the engine synced with the policy at the start and after every step, the progress bar, the checkpoint of the
step a run stops at, the monitor before each save and the healthy checkpoint its stop names."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo import paths
from grpo.cli import main
from grpo.config import load_config
from grpo.train import checkpoint as ckpt
from grpo.train import trainer
from tests.tiny_project import copy_prepared as copy_project
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """Data, base, SFT and pre-flight once for the module; each test copies it."""
    return prepared_project(tmp_path_factory.mktemp("tiny"))


def _recording_syncs(monkeypatch) -> list[str]:
    """The weights digest of every ``engine.sync_weights`` call of the trainer's own step, in order."""
    synced, built = [], trainer.build_training

    def recording(cfg, accelerator, shard=None):
        step = built(cfg, accelerator, shard=shard)
        sync = step.engine.sync_weights

        def record(model):
            synced.append(trainer.weights_digest(model))
            return sync(model)

        step.engine.sync_weights = record
        return step

    monkeypatch.setattr(trainer, "build_training", recording)
    return synced


def test_the_loop_syncs_its_engine_shows_its_progress_and_saves_the_step_it_stops_at(project, tmp_path,
                                                                                   capsys, monkeypatch):
    """``grpo train --max-steps`` in process, twice: the engine gets the policy's weights before the first
    step and after every step (a resumed run's first sync carries the resumed weights), the terminal shows
    the progress bar with each step's reward, entropy and kinds, the step a run stops at is checkpointed off
    the cadence, and the last line counts the new and restored steps and names the last step."""
    params = copy_project(project, tmp_path / "p")
    cadence = ["--set", "checkpoint.every=3"]  # step 1 is neither on the cadence nor a selection step (2, 4)
    # An entropy term moves the weights even where every group's rewards tie: each sync differs from the last.
    cadence += ["--set", "grpo.loss.entropy_coef=0.01"]
    assert main(["preflight", "--params", str(params), *cadence[2:]]) == 0  # the gate checks this loss
    capsys.readouterr()
    synced = _recording_syncs(monkeypatch)
    assert main(["train", "--params", str(params), "--max-steps", "1", *cadence]) == 0
    out, err = capsys.readouterr()
    run_dir = params.parent / "runs" / "tiny"
    assert len(synced) == 2 and ckpt.checkpoint_steps(run_dir) == [1]
    assert "grpo: 1 new step in " in out and "no policy written yet: step 1 of grpo.steps=4" in out
    bar = err.split("\r")[-1]  # the bar's last state: this run's one step, with that step's fields
    assert bar.startswith("grpo: 100%") and "1/1" in bar, err[-2000:]
    assert all(f"{field}=" in bar for field in ("reward", "entropy", "step_time", "kinds")), bar

    first_run = list(synced)
    assert first_run[1] != first_run[0], "step 1 moved no weight: the syncs would not tell before from after"
    synced.clear()
    assert main(["train", "--params", str(params), "--max-steps", "2", *cadence]) == 0
    out, err = capsys.readouterr()
    assert "2/2" in err.split("\r")[-1], err[-2000:]
    assert len(synced) == 3 and synced[0] == first_run[-1], "the resumed run's engine starts from other weights"
    assert "grpo: 2 new steps after 1 restored from its checkpoint" in out, out[-2000:]
    assert "no policy written yet: step 3 of grpo.steps=4" in out, out[-2000:]
    assert ckpt.checkpoint_steps(run_dir) == [1, 2, 3]


def test_train_refuses_params_its_preflight_did_not_check_before_it_writes_anything(project, tmp_path):
    """Another multitask mode than the gate ran: ``train`` stops naming ``grpo preflight`` before it builds
    a step, and the run's folder stays as it was."""
    from grpo.provenance.gate import PreflightError

    params = copy_project(project, tmp_path / "p")
    cfg = load_config(params, ["grpo.multitask.mode=pcgrad"])
    before = sorted(p.relative_to(params.parent) for p in params.parent.rglob("*"))
    with pytest.raises(PreflightError, match="grpo preflight"):
        trainer.train(cfg, progress=False)
    assert sorted(p.relative_to(params.parent) for p in params.parent.rglob("*")) == before


def test_a_collapse_after_a_healthy_checkpoint_names_that_checkpoint(project, tmp_path, monkeypatch, capsys):
    """Entropy collapsing at step 2 (simulated on the real step's metrics) under a stop rule of one step:
    the run stops at step 2 before saving it, and the message names step 1's checkpoint as the last
    healthy one."""
    from grpo.health.monitor import TrainingStopped

    params = copy_project(project, tmp_path / "p")
    real = trainer.grpo_step

    def collapsing(step, records, index, *args, **kwargs):
        result = real(step, records, index, *args, **kwargs)
        if index >= 2:
            result.metrics.update({"entropy": 0.0, "policy/entropy": 0.0})
        return result

    monkeypatch.setattr(trainer, "grpo_step", collapsing)
    cfg = load_config(params, ["monitor.entropy_floor.window=1", "monitor.entropy_floor.action=stop"])
    with pytest.raises(TrainingStopped, match=r"The checkpoint of step 1, the last before step 2, is the last "
                                              r"healthy one"):
        trainer.train(cfg, progress=False)
    assert ckpt.checkpoint_steps(paths.run_dir(cfg)) == [1]
    assert "grpo:" not in capsys.readouterr().err  # progress=False: no bar


def test_a_step_the_monitor_stops_never_becomes_a_checkpoint(project, tmp_path, capsys):
    """The monitor looks at each step before it is saved: a run the monitor stops at step 2 (a rule whose
    window of 2 steps holds from step 1) ends with step 1's checkpoint as its last."""
    params = copy_project(project, tmp_path / "p")
    rule = ["threshold=100", "window=2", "action=stop"]  # entropy below 100 nats: from the first step on
    sets = [arg for setting in rule for arg in ("--set", f"monitor.entropy_floor.{setting}")]
    assert main(["train", "--params", str(params), *sets]) == 1
    assert ckpt.checkpoint_steps(params.parent / "runs" / "tiny") == [1]
    assert "monitor.entropy_floor.action: warn" in capsys.readouterr().err  # the stop says which rule
