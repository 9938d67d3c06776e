"""A stage task's final state: named for what happened, its message one line, a retry on the record.

- ``Ran`` / ``Skipped`` (Completed; result ``True`` / ``False``): DVC ran the stage, or found it up to
  date and ran nothing. ``Ran on attempt N`` / ``Skipped on attempt N``: earlier attempts failed and
  Prefect retried; the message names each failed attempt and its reason.
- ``Failed``: the message is the one-line reason (``StageFailed``'s: the CLI's own ``error:`` line).
  The task returns this state instead of raising, so Prefect logs no traceback in front of the reason;
  Prefect still retries it when ``retry_condition_fn`` says so (it reads the exception in ``data``).

The task run is also renamed ``<stage>: <state name>`` (``sft: skipped``): the flow run's graph colours
nodes by state type, so Ran and Skipped, both Completed, look alike there; their names tell them apart.
"""

from __future__ import annotations

from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import TaskRunContext
from prefect.runtime import task_run
from prefect.states import Completed, Failed, State

from tasks.dvc_stage import run_stage
from tasks.retry import InjectedFailure, StageFailed

_FAILED_ATTEMPTS: dict[str, list[str]] = {}
"""``{task run id: ["attempt 1: <reason>", ...]}``: Prefect retries a task in the same process, and the
state of a retried attempt (AwaitingRetry) keeps no message, so the reasons are kept here."""


def label_task_run(stage: str, state_name: str) -> None:
    """Rename the running task run ``<stage>: <state name>``; a failure to rename is only logged.

    The engine's own copy is renamed too: the server records a task run from the engine's state events,
    each of which carries its name, so the final state's event would otherwise undo the rename.
    """
    name = f"{stage}: {state_name.lower()}"
    context = TaskRunContext.get()
    if context is not None and context.task_run is not None:
        context.task_run.name = name
    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_name(UUID(task_run.id), name)
    except Exception as exc:  # noqa: BLE001 - a label must never fail the stage
        get_run_logger().warning("could not rename the task run of stage %s: %s", stage, exc)


def stage_state(stage: str, ran: bool) -> State:
    """``Ran`` or ``Skipped`` (``... on attempt N`` after a retry, with the failed attempts' reasons)."""
    attempt = task_run.run_count
    failed = _FAILED_ATTEMPTS.pop(task_run.id, [])
    name = "Ran" if ran else "Skipped"
    what = f"stage {stage} ran" if ran else f"DVC: stage {stage} was up to date; nothing ran"
    if attempt > 1:
        name = f"{name} on attempt {attempt}"
        what = f"{what} on attempt {attempt}, retried after " + "; ".join(failed or ["a failed attempt"])
    label_task_run(stage, name)
    return Completed(name=name, message=what, data=ran)


def failed_state(stage: str, exc: StageFailed | InjectedFailure) -> State:
    """``Failed`` with the one-line reason; the exception rides along for ``retry_transient``."""
    attempt = task_run.run_count
    _FAILED_ATTEMPTS.setdefault(task_run.id, []).append(f"attempt {attempt} failed: {exc}")
    label_task_run(stage, "failed" if attempt <= 1 else f"failed on attempt {attempt}")
    return Failed(message=str(exc), data=exc)


def stage_result(stage: str, project_dir: str, force: bool = False, poll=None) -> State:
    """Run DVC stage ``stage`` (``run_stage``) and return the task's final state, failed or not."""
    try:
        ran = run_stage(stage, project_dir, force, poll)
    except (StageFailed, InjectedFailure) as exc:
        return failed_state(stage, exc)
    return stage_state(stage, ran)
