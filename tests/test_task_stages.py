"""tasks/dvc_stage.py, tasks/states.py, tasks/train.py and tasks/notify.py outside a Prefect run (fast): how a
task runs its DVC stage, reads why it failed, carries that to the retry rule, starts over when forced, and
says how to start the run again. ``tests/test_flows.py`` runs them in real flows (slow)."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from tasks import dvc_stage, notify, states
from tasks import train as train_task
from tasks.retry import StageFailed, retry_transient

KILLED = "ERROR: failed to reproduce 'grpo': failed to run: grpo train, exited with -9"


@pytest.fixture
def outside_a_run(monkeypatch):
    """The Prefect run context the tasks read, stood in for: a plain logger and the first attempt."""
    logger = logging.getLogger("tasks-under-test")
    for module in (dvc_stage, states, train_task):
        monkeypatch.setattr(module, "get_run_logger", lambda: logger, raising=False)
        monkeypatch.setattr(module, "task_run", SimpleNamespace(run_count=1, id="run-1"), raising=False)
    monkeypatch.setattr(states, "label_task_run", lambda stage, name: None)


def test_a_stage_is_run_alone_and_its_kill_read_from_dvcs_stderr(tmp_path, monkeypatch, outside_a_run):
    """DVC prints the stage command's fate on stderr while its stdout holds the stage's own output: a stage
    killed by signal 9 is a transient failure (retried), not DVC's own 255."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    ran = []

    def dvc(cmd, project, poll, kill_once=False):
        ran.append(cmd)
        return 255, ["Running stage 'grpo':", "> grpo train", "grpo: step 3 of 4"], [KILLED]

    monkeypatch.setattr(dvc_stage, "_run_dvc", dvc)
    with pytest.raises(StageFailed) as failed:
        dvc_stage.run_stage("grpo", tmp_path, force=True)
    assert failed.value.transient and failed.value.exit_code == -9
    assert ran[0][2:] == ["dvc", "repro", "--single-item", "grpo", "--force"]  # this stage, not its upstream


def test_the_orchestration_lock_lives_in_the_project_whatever_the_working_folder(tmp_path, monkeypatch,
                                                                                  outside_a_run):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a served deployment and a manual run start in other folders
    code, out, _ = dvc_stage._run_dvc([sys.executable, "-c", "print('ran')"], project, None)
    assert code == 0 and out == ["ran"]
    assert (project / dvc_stage.LOCK_FILE).is_file() and not (elsewhere / ".dvc").exists()


def test_a_failed_state_carries_its_exception_to_the_retry_rule(outside_a_run):
    killed = StageFailed("the stage command was killed by signal 9 (SIGKILL)", "grpo", -9, transient=True)
    state = states.failed_state("grpo", killed)
    assert state.is_failed() and state.message == str(killed)
    assert retry_transient(None, None, state)
    assert not retry_transient(None, None, states.failed_state("grpo", StageFailed("bad params", "grpo", 2)))


def test_a_forced_run_starts_over_on_its_first_attempt_only(tmp_path, monkeypatch, outside_a_run):
    """A retry after a kill resumes from the checkpoints the first attempt wrote."""
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "checkpoint-00000002").mkdir(parents=True)
    monkeypatch.setattr(train_task, "task_run", SimpleNamespace(run_count=2, id="run-1"))
    train_task.start_over(run_dir)
    assert (run_dir / "checkpoint-00000002").is_dir()
    monkeypatch.setattr(train_task, "task_run", SimpleNamespace(run_count=1, id="run-1"))
    train_task.start_over(run_dir)
    assert not run_dir.exists()


def test_the_relaunch_line_keeps_the_runs_params_file():
    from_deployment = SimpleNamespace(parameters={"params_path": "configs/one-off.yaml"}, deployment_id="d")
    assert notify.relaunch(from_deployment).endswith(" -p params_path=configs/one-off.yaml`")
    plain = SimpleNamespace(parameters={}, deployment_id=None)
    assert notify.relaunch(plain) == "`python -m flows.full_retrain`"
