"""Task ``prepare``: generate or load the dataset into data/processed (DVC stage ``prepare``)."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.dvc_stage import run_stage, stage_state


@task(name="prepare")
def prepare(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``prepare``; a bad raw file is not transient, so no retries."""
    return stage_state("prepare", run_stage("prepare", project_dir, force))
