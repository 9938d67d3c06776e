"""Task ``preflight``: invariants I1-I12 on the configured model (DVC stage ``preflight``)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_rows
from tasks.dvc_stage import run_stage, stage_state


@task(name="preflight")
def preflight(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``preflight``; a broken invariant is not transient: no retries, the flow stops."""
    report = Path(project_dir) / paths.report_file(project_config(project_dir), "preflight.json")
    try:
        return stage_state("preflight", run_stage("preflight", project_dir, force))
    finally:
        publish_rows(report, "checks", "preflight-checks", "Pre-flight checks I1-I12")
