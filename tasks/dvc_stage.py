"""Run one DVC stage the way every Prefect task does: offline, one at a time, failures with their reason.

Each task runs ``dvc repro --single-item <stage>`` in the project folder, so DVC alone decides whether
the stage is stale (DESIGN.md "Layers"); the task only adds retries and artifacts around it.

One DVC run at a time: DVC's own repo lock makes a second concurrent ``dvc repro`` fail at once
("Unable to acquire lock"), which would turn two overlapping flow runs into a spurious failure. Tasks
therefore take an exclusive file lock (``.dvc/tmp/orchestration.lock``, via ``filelock``) around each
DVC call and wait for it instead. A file lock rather than a Prefect tag concurrency limit: it needs no
server-side setup (``prefect concurrency-limit create``), works the same under the test harness, a
served deployment and a plain ``python -m flows.full_retrain``, and it lives with the project
folder, which is the resource actually shared.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil
from filelock import FileLock
from prefect import get_run_logger
from prefect.runtime import task_run

from tasks.retry import InjectedFailure, StageFailed, exit_cause, failure_reason

LOCK_FILE = Path(".dvc/tmp/orchestration.lock")
TAIL_LINES = 40
POLL_SECONDS = 3.0
FAIL_ONCE_ENV = "GRPO_DUAL_FAIL_ONCE"
"""Test hook: comma-separated stages whose first attempt is killed (SIGKILL of the stage command once it
runs; a stage DVC finds up to date raises ``InjectedFailure`` instead). Prefect then retries it."""

# Forced: the project never reports usage, whoever starts it.
NO_TELEMETRY = {"DO_NOT_TRACK": "1", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
# Defaults: nothing is fetched at run time unless the caller's environment deliberately says otherwise.
OFFLINE_DEFAULTS = {
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TQDM_MININTERVAL": "10",  # progress bars become log lines here: one every 10 s is enough
}


def stage_env(project: Path) -> dict[str, str]:
    """The environment of a stage: offline, the project's own code first, the venv's tools on PATH."""
    env = {**OFFLINE_DEFAULTS, **os.environ, **NO_TELEMETRY}
    # The trainer passes wandb.init(dir=runs/<experiment>), so its runs land in runs/<experiment>/wandb;
    # WANDB_DIR keeps whatever else wandb writes inside the project too, never in the caller's cwd.
    env.setdefault("WANDB_DIR", str(project))
    env["DVC_SITE_CACHE_DIR"] = str(project / ".dvc" / "tmp" / "site_cache")
    # `grpo` must run the code in `project` (what the fingerprints hash), not another installed copy.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(project), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _fail_once(stage: str) -> bool:
    """Whether this attempt of ``stage`` must fail: listed in GRPO_DUAL_FAIL_ONCE and the first attempt."""
    listed = {name.strip() for name in os.environ.get(FAIL_ONCE_ENV, "").split(",")}
    return stage in listed and task_run.run_count <= 1


def _kill_stage_command(proc: subprocess.Popen) -> bool:
    """SIGKILL the stage command DVC started (its child processes), as the OOM killer would; True if one was."""
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGKILL)
    return bool(children)


def _pump(stream, sink: deque[str], log: Callable[[str], None]) -> None:
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            sink.append(line)
            log(line)


def _wait(proc: subprocess.Popen, poll: Callable[[], None] | None, kill_once: bool = False) -> None:
    """Wait for the stage, calling ``poll`` every few seconds; a failing poll is logged, not fatal."""
    while True:
        try:
            proc.wait(timeout=0.5 if kill_once else POLL_SECONDS)
            return
        except subprocess.TimeoutExpired:
            if kill_once and _kill_stage_command(proc):
                kill_once = False
            if poll is None:
                continue
            try:
                poll()
            except Exception as exc:  # progress reporting must never fail a training run
                get_run_logger().warning("progress update failed: %s", exc)


def command_line(project: Path, cmd: list[str]) -> str:
    """The stage's command as a line a user can paste into any shell: folder, code path and tools included."""
    env = stage_env(project)
    tools = shlex.quote(str(Path(sys.executable).parent))
    return (
        f'cd {shlex.quote(str(project))} && PATH={tools}:"$PATH" PYTHONPATH={shlex.quote(env["PYTHONPATH"])} '
        f"{shlex.join(cmd)}"
    )


def _run_dvc(
    cmd: list[str], project: Path, poll: Callable[[], None] | None, kill_once: bool = False
) -> tuple[int, list[str], list[str]]:
    """Run ``cmd`` under the orchestration lock, its output logged line by line; (exit code, stdout, stderr)."""
    logger = get_run_logger()
    out: deque[str] = deque(maxlen=2000)
    err: deque[str] = deque(maxlen=TAIL_LINES)
    lock = project / LOCK_FILE
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock):
        logger.info("$ %s", command_line(project, cmd))
        proc = subprocess.Popen(
            cmd,
            cwd=project,
            env=stage_env(project),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        readers = [
            threading.Thread(target=_pump, args=(proc.stdout, out, logger.info), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, err, logger.info), daemon=True),
        ]
        for reader in readers:
            reader.start()
        try:
            _wait(proc, poll, kill_once)
        finally:  # cancelled or interrupted: never leave a DVC run behind holding the repo lock
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
        for reader in readers:
            reader.join()
    return proc.returncode, list(out), list(err)


def run_stage(
    stage: str, project_dir: str | Path, force: bool = False, poll: Callable[[], None] | None = None
) -> bool:
    """``dvc repro --single-item <stage>`` in ``project_dir``; True when the stage ran, False when up to date.

    ``poll`` is called every few seconds while the stage runs (progress artifacts). A non-zero exit
    is logged at ERROR with its real cause (the stage command's exit code or signal, not DVC's 255)
    and raises ``StageFailed``: its message the one-line reason (the CLI's ``error:`` line), its
    ``details`` the command and the last lines of stderr; ``StageFailed.transient`` says whether a
    retry can help (tasks/retry.py).
    """
    logger = get_run_logger()
    kill_once = _fail_once(stage)
    project = Path(project_dir).resolve()
    if not (project / "dvc.yaml").is_file():
        raise StageFailed(
            f"{project}/dvc.yaml does not exist: project_dir must be the grpo-dual project root", stage
        )
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    returncode, out, err = _run_dvc(cmd, project, poll, kill_once)
    if kill_once and returncode == 0:
        logger.error(
            "stage %s: %s=%s, but DVC found it up to date: failing attempt 1 anyway",
            stage,
            FAIL_ONCE_ENV,
            stage,
        )
        raise InjectedFailure(f"{FAIL_ONCE_ENV}={stage}: failing attempt 1 of stage {stage!r} on purpose")
    if returncode != 0:
        cause = exit_cause(returncode, err or out)
        reason = failure_reason(err or out, cause)
        how = "" if reason == cause.describe() else f"{cause.describe()}; "
        retry = "transient: Prefect retries it" if cause.transient else "deterministic: not retried"
        logger.error(
            "stage %s failed on attempt %d: %s (%s%s)", stage, task_run.run_count, reason, how, retry
        )
        tail = "\n".join(err) or "\n".join(out[-TAIL_LINES:])
        raise StageFailed(
            reason,
            stage,
            cause.code,
            cause.transient,
            details=f"DVC stage {stage!r}: {cause.describe()}.\n\n$ {command_line(project, cmd)}\n\n"
            f"The last lines of its stderr:\n\n{tail}",
        )
    ran = any(line.startswith(f"Running stage '{stage}'") for line in out)
    logger.info("stage %s %s", stage, "ran" if ran else "was up to date (DVC skipped it)")
    return ran
