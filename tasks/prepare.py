"""Task ``prepare``: generate or load the dataset into data/processed (DVC stage ``prepare``)."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.states import stage_result


@task(name="prepare")
def prepare(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``prepare``; a bad raw file is not transient, so no retries."""
    return stage_result("prepare", project_dir, force)
