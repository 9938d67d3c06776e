"""Task ``validate``: the data gate (DVC stage ``validate``); its report is published pass or fail."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_markdown
from tasks.states import stage_result


@task(name="validate")
def validate(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``validate``; bad data is not transient: no retries, the flow stops here."""
    report = Path(project_dir) / paths.report_file(project_config(project_dir), "validation.md")
    state = stage_result("validate", project_dir, force)
    publish_markdown(report, "validation-report", "Data validation (validate stage)")
    return state
