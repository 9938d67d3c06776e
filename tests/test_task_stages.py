"""tasks/dvc_stage.py, tasks/states.py, tasks/train.py, tasks/notify.py, tasks/params.py, tasks/evaluate.py and
tasks/artifacts.py outside a Prefect run (fast): how a task runs its DVC stage, reads why it failed, carries that
to the retry rule, starts over when forced, says how to start the run again, picks the folder the stages run in,
and publishes what its stage wrote (nothing when the stage failed). ``tests/test_flows.py`` runs them in real
flows (slow)."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prefect.states import Completed

from grpo.config import config_from_dict
from grpo.eval.keymetrics import key_metrics_path
from tasks import artifacts, dvc_stage, notify, states
from tasks import evaluate as evaluate_task
from tasks import params as params_task
from tasks import train as train_task
from tasks.retry import StageFailed, retry_transient

KILLED = "ERROR: failed to reproduce 'grpo': failed to run: grpo train, exited with -9"


@pytest.fixture
def outside_a_run(monkeypatch):
    """The Prefect run context the tasks read, stood in for: a plain logger and the first attempt."""
    logger = logging.getLogger("tasks-under-test")
    for module in (dvc_stage, states, train_task, params_task, artifacts):
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


def test_the_params_task_validates_the_file_and_names_the_folder_the_stages_run_in(tmp_path, outside_a_run):
    """The project's params.yaml: the project; another file: its workspace; a bad file fails naming the key."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "params.yaml").write_text("seed: 1\n")
    (project / "configs" / "p.yaml").write_text("extends: ../params.yaml\nseed: 2\n")
    (project / "configs" / "bad.yaml").write_text("extends: ../params.yaml\ngrpo:\n  group_size: 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the project"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project, check=True)
    own = params_task.use_params.fn(str(project), "params.yaml")
    assert own.is_completed() and own.data == str(project.resolve())
    other = params_task.use_params.fn(str(project), "configs/p.yaml")
    assert other.is_completed() and other.data == str(project.resolve() / ".workspaces" / "p")
    bad = params_task.use_params.fn(str(project), "configs/bad.yaml")
    assert bad.is_failed() and "grpo.group_size" in bad.message and "configs/bad.yaml" in bad.message
    assert not (project / ".workspaces" / "bad").exists(), "a bad file gets no workspace"


@pytest.fixture
def published(monkeypatch):
    """Every artifact the tasks publish, recorded instead of sent to a Prefect server."""
    out = []
    for module in (artifacts, evaluate_task):
        for name in ("create_markdown_artifact", "create_table_artifact"):
            monkeypatch.setattr(module, name, lambda name=name, **kwargs: out.append((name, kwargs)), raising=False)
    return out


def test_evaluate_publishes_its_stages_key_rows_and_nothing_when_the_stage_failed(tmp_path, monkeypatch,
                                                                                   outside_a_run, published):
    cfg = config_from_dict({})
    (tmp_path / "params.yaml").write_text("seed: 1\n")
    rows = tmp_path / key_metrics_path(cfg, "evaluate")
    rows.mkdir(parents=True)
    (rows / "accuracy.json").write_text('{"sft": 0.5, "grpo": 0.75}')
    failed = states.failed_state("evaluate", StageFailed("the stage failed", "evaluate", 1))
    monkeypatch.setattr(evaluate_task, "stage_result", lambda *args: failed)
    assert evaluate_task.evaluate.fn(str(tmp_path)) is failed and published == []
    monkeypatch.setattr(evaluate_task, "stage_result", lambda *args: Completed())
    assert evaluate_task.evaluate.fn(str(tmp_path)).is_completed()
    tables = [kwargs for name, kwargs in published if kwargs.get("key") == "eval-metrics"]
    assert tables == [{"table": [{"metric": "accuracy", "sft": 0.5, "grpo": 0.75}], "key": "eval-metrics",
                       "description": "Key evaluation rows, greedy (metrics/key/evaluate/)"}]


def test_a_missing_figure_is_skipped_and_the_others_published(tmp_path, outside_a_run, published):
    (tmp_path / "eval.png").write_bytes(b"\x89PNG")
    artifacts.publish_figures({"absent": tmp_path / "entropy.png", "present": tmp_path / "eval.png"}, "curves", "d")
    assert len(published) == 1 and "### present" in published[0][1]["markdown"]
    assert "absent" not in published[0][1]["markdown"]
    artifacts.publish_figures({"absent": tmp_path / "entropy.png"}, "curves", "d")
    assert len(published) == 1, "no figure: no artifact"


def test_a_stopped_flow_names_its_stage_and_the_failure_file_carries_the_details(tmp_path, monkeypatch,
                                                                                 outside_a_run):
    """The flow's final state is ``<stage> failed: <reason>``; the failure hook finds what ``stopped`` recorded
    for this run (by its id) and writes the stage, the reason and the stage's details; a clean run's hook
    removes the failure file, and finds nothing to remove without complaint."""
    monkeypatch.setattr(notify, "current_flow_run", SimpleNamespace(id="run-7"))
    monkeypatch.setattr(notify, "get_run_logger", lambda: logging.getLogger("tasks-under-test"))
    killed = StageFailed("the stage command was killed by signal 9 (SIGKILL)", "grpo", -9, transient=True,
                         details="command: grpo train\nstderr tail: Killed")
    final = notify.stopped("grpo", states.failed_state("grpo", killed), "params.yaml")
    assert final.message == "grpo failed: the stage command was killed by signal 9 (SIGKILL)"
    flow_run = SimpleNamespace(id="run-7", name="brave-fox", deployment_id=None,
                               parameters={"project_dir": str(tmp_path), "params_path": "params.yaml"})
    report = notify.failure_report(flow_run, final)
    assert report.startswith("# full-retrain failed at grpo\n")
    assert "**Why:** the stage command was killed by signal 9 (SIGKILL)" in report
    assert "## Details" in report and "stderr tail: Killed" in report
    path = notify.failure_file(flow_run)
    notify.clear_failure(None, flow_run, final)  # no failure file yet: nothing to do
    path.parent.mkdir(parents=True)
    path.write_text(report)
    notify.clear_failure(None, flow_run, final)
    assert not path.exists()


def _stage_runs(monkeypatch, tmp_path, code, out, err):
    """``run_stage`` over a DVC run that ended with ``code`` and printed ``out`` and ``err``, and the commands
    it was asked to run."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    commands = []

    def dvc(cmd, project, poll, kill_once=False):
        commands.append(cmd)
        return code, out, err

    monkeypatch.setattr(dvc_stage, "_run_dvc", dvc)
    return lambda: dvc_stage.run_stage("sft", tmp_path), commands


def test_a_stage_ran_only_when_dvc_says_it_ran_it(tmp_path, monkeypatch, outside_a_run):
    ran, commands = _stage_runs(monkeypatch, tmp_path, 0, ["Running stage 'sft':", "> grpo sft", "sft: loss 0.5"], [])
    assert ran() is True
    assert commands[0][-1] == "sft", "a stage is forced only when asked"
    skipped, _ = _stage_runs(monkeypatch, tmp_path, 0, ["Stage 'sft' didn't change, skipping"], [])
    assert skipped() is False


def test_an_exit_of_1_fails_the_stage_with_the_clis_reason_from_stderr_else_stdout(tmp_path, monkeypatch,
                                                                                  outside_a_run):
    """The reason comes from stderr, else from stdout; without stderr the details hold the last
    ``TAIL_LINES`` lines of stdout, none before them."""
    on_stderr, _ = _stage_runs(monkeypatch, tmp_path, 1, ["Running stage 'sft':"], ["error: params.yaml: bad lr"])
    with pytest.raises(StageFailed, match=r"^params\.yaml: bad lr$") as failed:
        on_stderr()
    assert not failed.value.transient and "error: params.yaml: bad lr" in failed.value.details
    out = [f"line {i}" for i in range(100)] + ["error: params.yaml: bad steps"]
    with pytest.raises(StageFailed, match=r"^params\.yaml: bad steps$") as failed:
        _stage_runs(monkeypatch, tmp_path, 2, out, [])[0]()
    tail = failed.value.details.split("The last lines of its stderr:\n\n")[1].splitlines()
    assert tail == out[-dvc_stage.TAIL_LINES:]


def test_the_fail_once_hook_fails_a_first_attempt_that_dvc_found_up_to_date(tmp_path, monkeypatch, outside_a_run):
    from tasks.retry import InjectedFailure

    monkeypatch.setenv(dvc_stage.FAIL_ONCE_ENV, "prepare, sft")
    run, _ = _stage_runs(monkeypatch, tmp_path, 0, ["Stage 'sft' didn't change, skipping"], [])
    with pytest.raises(InjectedFailure, match="failing attempt 1 of stage 'sft'"):
        run()
    monkeypatch.setattr(dvc_stage, "task_run", SimpleNamespace(run_count=2, id="run-1"))
    assert run() is False  # the retry runs as usual


def test_the_wait_polls_while_the_stage_runs_and_a_failing_poll_is_not_fatal(tmp_path, monkeypatch, outside_a_run):
    """Both streams are logged line by line; ``poll`` runs every ``POLL_SECONDS`` and may raise."""
    monkeypatch.setattr(dvc_stage, "POLL_SECONDS", 0.1)
    polls = []

    def poll():
        polls.append(1)
        raise RuntimeError("the progress artifact is down")

    logged = []
    monkeypatch.setattr(dvc_stage, "get_run_logger", lambda: SimpleNamespace(
        info=lambda *args: logged.append(args[0] % args[1:] if len(args) > 1 else args[0]),
        warning=lambda *args: logged.append("warning: " + args[0] % args[1:])))
    child = "import time; time.sleep(0.6)"  # a stage command longer than a poll: left alone
    script = (f"import subprocess, sys; print('out line'); print('err line', file=sys.stderr); sys.stdout.flush(); "
              f"print('child ended', subprocess.run([sys.executable, '-c', {child!r}]).returncode)")
    code, out, err = dvc_stage._run_dvc([sys.executable, "-c", script], tmp_path, poll)
    assert (code, out, err) == (0, ["out line", "child ended 0"], ["err line"])
    assert len(polls) >= 2 and "warning: progress update failed: the progress artifact is down" in logged
    assert {"out line", "err line"} <= set(logged)


def test_the_fail_once_hook_kills_the_stage_command_not_dvc(tmp_path, outside_a_run):
    """``kill_once``: the child the DVC process started is SIGKILLed (as the OOM killer would), once; the
    parent goes on and reports it."""
    child, second = "import time; time.sleep(60)", "import time; time.sleep(1.5)"
    parent = (f"import subprocess, sys; print('child ended', subprocess.run([sys.executable, '-c', {child!r}]).returncode); "
              f"print('second ended', subprocess.run([sys.executable, '-c', {second!r}]).returncode)")
    code, out, _ = dvc_stage._run_dvc([sys.executable, "-c", parent], tmp_path, None, kill_once=True)
    assert code == 0 and out == ["child ended -9", "second ended 0"]


def test_an_interrupted_wait_leaves_no_dvc_run_behind(tmp_path, monkeypatch, outside_a_run):
    """A cancelled task (an interrupt while it waits): the DVC process is terminated and reaped, and the
    lock is free for the next run."""
    import psutil

    pid_file = tmp_path / "pid"

    def interrupt():
        if pid_file.is_file() and pid_file.read_text():  # once the stage has started
            raise KeyboardInterrupt

    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    monkeypatch.setattr(dvc_stage, "POLL_SECONDS", 0.2)
    with pytest.raises(KeyboardInterrupt):
        dvc_stage._run_dvc([sys.executable, "-c", script], tmp_path, interrupt)
    assert not psutil.pid_exists(int(pid_file.read_text()))
    assert dvc_stage._run_dvc([sys.executable, "-c", "print('next')"], tmp_path, None)[:2] == (0, ["next"])
