"""Task ``validate``: the data gate (DVC stage ``validate``); its report is published pass or fail."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from tasks.artifacts import project_config, publish_markdown
from tasks.dvc_stage import run_stage, stage_state


@task(name="validate")
def validate(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``validate``; bad data is not transient: no retries, the flow stops here."""
    reports = Path(project_dir) / project_config(project_dir).paths.reports_dir
    try:
        return stage_state("validate", run_stage("validate", project_dir, force))
    finally:
        publish_markdown(reports / "validation.md", "validation-report", "Data validation (validate stage)")
