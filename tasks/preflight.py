"""Task ``preflight``: invariants I1-I12 on the configured model (DVC stage ``preflight``)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_markdown, publish_text
from tasks.reports import preflight_markdown
from tasks.states import stage_result


@task(name="preflight")
def preflight(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``preflight``; a broken invariant is not transient: no retries, the flow stops.

    Published pass or fail: ``preflight-checks`` (the overall line and one row per check) and
    ``preflight-details`` (``reports/preflight.md``: every value, bound and detail in full).
    """
    report = Path(project_dir) / paths.report_file(project_config(project_dir), "preflight.json")
    state = stage_result("preflight", project_dir, force)
    if report.is_file():
        details = (
            f"Every value, bound and detail in full: the `preflight-details` artifact, "
            f"`{report.with_suffix('.md')}` (raw values: `{report}`)."
        )
        publish_text(
            preflight_markdown(json.loads(report.read_text(encoding="utf-8")), details),
            "preflight-checks",
            "Pre-flight checks I1-I12",
        )
    publish_markdown(report.with_suffix(".md"), "preflight-details", "Pre-flight checks in full")
    return state
