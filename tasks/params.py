"""Task ``params``: check the run's params file and choose where the run works (project or workspace)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.states import Completed, Failed, State

from grpo.config import ConfigError, load_config
from tasks.notify import for_flow_run
from tasks.workspace import WorkspaceError, run_folder


@task(name="params")
def use_params(project_dir: str, params_path: str = "params.yaml") -> State:
    """Validate ``params_path`` (relative to the project); the result is the folder the stages run in.

    ``params.yaml`` itself: the project. Any other file: its own workspace (tasks/workspace.py), so a
    one-off run never writes the project's ``params.yaml`` nor its outputs. A bad file fails the task
    (no traceback) with the key, the value and the fix in that file: a flow run takes no ``--set``.
    """
    project = Path(project_dir).resolve()
    source = (project / params_path).resolve()
    if not source.is_file():
        return Failed(
            message=f"{params_path}: no such params file; params_path is relative to the project folder "
            f"({project}), e.g. -p params_path=configs/smollm2.yaml"
        )
    try:
        load_config(source)
        workspace = run_folder(project, source)
    except (ConfigError, WorkspaceError) as exc:
        problems = str(exc).splitlines()
        more = f" (and {len(problems) - 1} more: see the details)" if len(problems) > 1 else ""
        return Failed(message=for_flow_run(problems[0], params_path) + more, data=exc)
    if workspace != project:
        get_run_logger().warning(
            "params: %s is not the project's params.yaml, so this run works in %s (its own params.yaml, "
            "dvc.lock and outputs; the project's are untouched)",
            source,
            workspace,
        )
    return Completed(message=f"the stages run in {workspace}", data=str(workspace))
