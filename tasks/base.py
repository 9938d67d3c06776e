"""Task ``base``: build the embedded tiny model or resolve the configured one (DVC stage ``base``)."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.states import stage_result


@task(name="base")
def base(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``base``; local and deterministic, so no retries."""
    return stage_result("base", project_dir, force)
