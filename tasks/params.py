"""Task ``params``: check the run's params file and choose where the run works (project or workspace)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from grpo.config import load_config
from tasks.workspace import run_folder


@task(name="params")
def use_params(project_dir: str, params_path: str = "params.yaml") -> str:
    """Validate ``params_path`` (relative to the project); return the folder the stages run in.

    ``params.yaml`` itself: the project. Any other file: its own workspace (tasks/workspace.py), so a
    one-off run never writes the project's ``params.yaml`` nor its outputs. A bad file stops the flow
    here with the key, the value and the fix.
    """
    project = Path(project_dir).resolve()
    source = (project / params_path).resolve()
    load_config(source)
    workspace = run_folder(project, source)
    if workspace == project:
        return str(project)
    get_run_logger().warning(
        "params: %s is not the project's params.yaml, so this run works in %s (its own params.yaml, dvc.lock "
        "and outputs; the project's are untouched)",
        source,
        workspace,
    )
    return str(workspace)
