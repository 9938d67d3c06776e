"""Which stage failures are worth a retry, and what exactly ended the stage.

A retry only helps when running the same code on the same inputs again can succeed: the stage was
killed (the OOM killer, a preempted machine: a signal) or it hit a device or network error. Everything
else is deterministic and fails the task at once instead of waiting 10-120 s for the same result: the
CLI's own errors (``error: ...``: a ``StaleArtifactError``, a broken data rule, a bad params value),
DVC's errors (a missing dependency, an invalid dvc.yaml) and any other crash.

DVC runs the stage command in a child process and exits 255 whatever happened to it; its last
``ERROR`` line holds the command's own exit status (``failed to run: grpo sft, exited with -9``), so
that is the cause reported, not DVC's 255. DVC runs the command through ``$SHELL``; a shell that
does not exec its last command (dash as ``/bin/sh``) reports a child killed by signal N as 128 + N
(and prints "Killed"), so such a status is read as the signal, the same cause bash reports as -N.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

_COMMAND_EXIT = re.compile(r"failed to run: .*, exited with (-?\d+)\s*$")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b:? ")
_SHELL_SIGNAL_BASE = 128
RETRY_DELAY_S = 30
"""Seconds before a retried stage runs again: one number (a list of delays shows as "Retry Delay: NaNs"
in the Prefect UI, whose task page expects a number); long enough for a neighbour's memory to free."""
TRANSIENT_ERRORS = ("OutOfMemoryError", "CUDA error", "NCCL", "ConnectionError", "TimeoutError")
"""Exception names in a stage's traceback that a retry can get past (a neighbour's memory, a network)."""


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; the message is the one-line reason (``failure_reason``).

    ``details``: the exit cause, the command and the tail of its stderr, for the logs and the failure
    report. ``transient`` says whether running it again may succeed (``retry_transient`` reads it).
    """

    def __init__(
        self,
        message: str,
        stage: str = "",
        exit_code: int | None = None,
        transient: bool = False,
        details: str = "",
    ):
        super().__init__(message)
        self.stage, self.exit_code, self.transient, self.details = stage, exit_code, transient, details


class InjectedFailure(RuntimeError):
    """The GRPO_DUAL_FAIL_ONCE test hook failed this attempt on purpose (treated as transient)."""


@dataclass(frozen=True)
class ExitCause:
    """How a stage ended: ``code`` < 0 means killed by signal ``-code``; ``of`` says whose status it is."""

    code: int
    of: str  # "stage command" (DVC's report of it) or "dvc" (DVC itself)
    transient: bool

    def describe(self) -> str:
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = "unknown signal"
            return f"the {self.of} was killed by signal {-self.code} ({name})"
        return f"the {self.of} exited with code {self.code}"


def exit_cause(returncode: int, output: Iterable[str]) -> ExitCause:
    """The real cause of a failed ``dvc repro``: the stage command's status when DVC reports one."""
    lines = list(output)
    codes = [int(m.group(1)) for line in lines if (m := _COMMAND_EXIT.search(line))]
    code, of = (codes[-1], "stage command") if codes else (returncode, "dvc")
    if of == "stage command" and _SHELL_SIGNAL_BASE < code <= _SHELL_SIGNAL_BASE + signal.NSIG:
        code = _SHELL_SIGNAL_BASE - code  # the shell's 128 + N: killed by signal N
    text = "\n".join(lines)
    transient = code < 0 or any(name in text for name in TRANSIENT_ERRORS)
    return ExitCause(code=code, of=of, transient=transient)


def failure_reason(lines: Iterable[str], cause: ExitCause) -> str:
    """One line that says why a stage failed: the CLI's own ``error:`` line (it names the file, the key,
    the value and the fix), else the exception a traceback ended with, else how the command ended."""
    lines = [line.strip() for line in lines if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1]
    raised = [line for line in lines if _RAISED.match(line)]
    return raised[-1] if raised else cause.describe()


def retry_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry a killed or device-failed stage, nothing deterministic."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, InjectedFailure) or (isinstance(exc, StageFailed) and exc.transient)
