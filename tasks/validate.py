"""Task ``validate``: the data gate (DVC stage ``validate``); its report is published pass or fail."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_markdown
from tasks.dvc_stage import run_stage, stage_state


@task(name="validate")
def validate(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``validate``; bad data is not transient: no retries, the flow stops here."""
    report = Path(project_dir) / paths.report_file(project_config(project_dir), "validation.md")
    try:
        return stage_state("validate", run_stage("validate", project_dir, force))
    finally:
        publish_markdown(report, "validation-report", "Data validation (validate stage)")
