"""Task ``base``: build the embedded tiny model or resolve the configured one (DVC stage ``base``)."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.dvc_stage import run_stage, stage_state


@task(name="base")
def base(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``base``; local and deterministic, so no retries."""
    return stage_state("base", run_stage("base", project_dir, force))
