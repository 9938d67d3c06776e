"""tasks/retry.py: the real exit cause of a DVC stage, and which failures Prefect retries.

The outputs are real: ``dvc repro`` in a throwaway git repo whose stages die the ways a pipeline
stage does (killed by SIGKILL, an ``error:`` exit of the CLI, a CUDA out-of-memory traceback).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from prefect.states import Failed

from tasks.dvc_stage import InjectedFailure, StageFailed
from tasks.retry import exit_cause, failure_reason, retry_transient

pytest.importorskip("dvc")

STAGE_SCRIPT = """import os, signal, sys
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "oom":
    raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
print("error: params.yaml: grpo.group_size must be >= 2 (got 1)", file=sys.stderr)
sys.exit(1)
"""


@pytest.fixture(scope="module")
def dvc_failures(tmp_path_factory) -> dict[str, tuple[int, list[str]]]:
    """``{stage: (dvc exit code, stderr lines)}`` of real `dvc repro --single-item` runs that fail."""
    repo = tmp_path_factory.mktemp("dvc_failures")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    (repo / "stage.py").write_text(STAGE_SCRIPT, encoding="utf-8")
    (repo / "dvc.yaml").write_text("stages:\n" + "".join(
        f"  {name}:\n    cmd: {sys.executable} stage.py {name}\n" for name in ("kill", "oom", "error")))
    out = {}
    for name in ("kill", "oom", "error"):
        proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", name], cwd=repo,
                              capture_output=True, text=True, timeout=120)
        out[name] = (proc.returncode, proc.stderr.splitlines())
    return out


def test_exit_cause_is_the_stage_commands_not_dvcs(dvc_failures):
    code, err = dvc_failures["kill"]
    assert code == 255  # DVC's own status says nothing about the kill ...
    cause = exit_cause(code, err)  # ... its last ERROR line does
    assert (cause.code, cause.of, cause.transient) == (-9, "stage command", True)
    assert cause.describe() == "the stage command was killed by signal 9 (SIGKILL)"


def test_a_shells_128_plus_n_status_is_signal_n():
    """dash as ``$SHELL`` reports the killed child as 137 and prints "Killed"; bash reports -9."""
    line = "ERROR: failed to reproduce 'grpo': failed to run: grpo grpo, exited with {}"
    assert exit_cause(255, ["Killed", line.format(137)]) == exit_cause(255, [line.format(-9)])
    assert exit_cause(255, [line.format(137)]).describe() == "the stage command was killed by signal 9 (SIGKILL)"
    assert exit_cause(255, [line.format(2)]).code == 2  # an ordinary exit status stays what it is
    assert exit_cause(137, ["ERROR: bad dvc.yaml"]).code == 137  # only the stage command's status is a shell's
    beyond = exit_cause(255, [line.format(255)])  # above 128 + the last signal: a plain exit status
    assert (beyond.code, beyond.transient) == (255, False)


def test_the_last_exit_line_decides_and_the_shells_signal_range_has_exact_ends():
    """DVC reports a stage's status once per failed command: the last report is the stage's. 128 itself is
    an exit status; 128 + N up to the last signal number is signal N."""
    import signal

    line = "ERROR: failed to reproduce 'grpo': failed to run: grpo grpo, exited with {}"
    assert exit_cause(255, [line.format(3), line.format(-9)]).code == -9
    assert exit_cause(255, [line.format(-9), line.format(3)]).code == 3
    assert exit_cause(255, [line.format(128)]).code == 128
    assert exit_cause(255, [line.format(129)]).describe() == "the stage command was killed by signal 1 (SIGHUP)"
    assert exit_cause(255, [line.format(128 + signal.NSIG)]).code == -signal.NSIG
    zero = exit_cause(0, [])
    assert not zero.transient and zero.describe() == "the dvc exited with code 0"


def test_of_several_cli_error_lines_the_last_is_the_reason():
    lines = ["error: params.yaml: grpo.lr must be > 0 (got 0)", "error: params.yaml: grpo.steps must be >= 1 (got 0)"]
    assert failure_reason(lines, exit_cause(2, lines)) == "params.yaml: grpo.steps must be >= 1 (got 0)"


def test_deterministic_failures_are_not_transient(dvc_failures):
    cause = exit_cause(*dvc_failures["error"])
    assert (cause.code, cause.transient) == (1, False)
    assert cause.describe() == "the stage command exited with code 1"
    assert exit_cause(255, ["ERROR: failed to reproduce 'sft': missing dependency"]) == exit_cause(
        255, ["ERROR: bad dvc.yaml"])  # DVC's own errors: deterministic, DVC's code reported
    assert not exit_cause(255, ["ERROR: bad dvc.yaml"]).transient


def test_device_errors_are_transient(dvc_failures):
    cause = exit_cause(*dvc_failures["oom"])
    assert (cause.code, cause.transient) == (1, True)


def test_a_collective_that_timed_out_is_transient():
    line = "ERROR: failed to reproduce 'grpo': failed to run: grpo train, exited with 1"
    nccl = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"
    assert exit_cause(255, [nccl, line]).transient
    assert not exit_cause(255, ["ValueError: a bug", line]).transient


def test_the_clis_error_line_wins_over_a_traceback():
    """A stage that logged a traceback and then failed with the CLI's ``error:`` line: the CLI's line (the
    file, the key, the fix) is the reason."""
    lines = ["Traceback (most recent call last):", '  File "grpo/cli.py", line 3, in main',
             "grpo.config.ConfigError: bad", "error: params.yaml: grpo.lr must be > 0 (got 0); fix it in params.yaml"]
    assert failure_reason(lines, exit_cause(2, lines)) == "params.yaml: grpo.lr must be > 0 (got 0); fix it in params.yaml"


def test_retry_condition_retries_only_transient_failures():
    def failed(exc: BaseException):
        return Failed(data=exc, message=str(exc))

    assert retry_transient(None, None, failed(StageFailed("killed", "grpo", -9, transient=True)))
    assert retry_transient(None, None, failed(InjectedFailure("hook")))
    assert not retry_transient(None, None, failed(StageFailed("StaleArtifactError", "grpo", 1, transient=False)))
    assert not retry_transient(None, None, failed(ValueError("a bug in a task")))



def test_the_reason_is_one_line_the_clis_error_or_the_exception_or_the_exit(dvc_failures):
    """The line a failed run's state message, ``--watch`` and last_failure.md lead with."""
    reasons = {name: failure_reason(err, exit_cause(code, err)) for name, (code, err) in dvc_failures.items()}
    assert reasons == {
        "error": "params.yaml: grpo.group_size must be >= 2 (got 1)",  # the CLI's own words, fix included
        "oom": "RuntimeError: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "kill": "the stage command was killed by signal 9 (SIGKILL)",
    }
    assert not any("Traceback" in reason or "\n" in reason for reason in reasons.values())


def test_a_chained_traceback_gives_the_exception_the_stage_died_of():
    chained = [
        "Traceback (most recent call last):", '  File "grpo/data/loaders.py", line 9, in read',
        "KeyError: 'knowledge'", "",
        "During handling of the above exception, another exception occurred:", "",
        "Traceback (most recent call last):", '  File "grpo/data/prepare.py", line 4, in run',
        "grpo.data.errors.DataSourceError: qa.json:3: not a HaluEval QA record",
    ]
    reason = failure_reason(chained, exit_cause(1, chained))
    assert reason == "grpo.data.errors.DataSourceError: qa.json:3: not a HaluEval QA record"
