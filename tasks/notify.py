"""Flow hooks that leave a failed run where a person sees it without opening the Prefect UI.

On failure: ``<project>/<runs_dir>/last_failure.md`` (the flow run, its state message with the failing
stage and the tail of its stderr, and how to look closer), the same text as the markdown artifact
``full-retrain-failure`` and one ERROR log line. On success the file is removed, so its presence means
"the last run failed". ``prefect deployment run full-retrain/full-retrain --watch`` also exits 1 on a
failed run, for a cron job or CI to mail.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import Flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import FlowRun, State

from grpo.config import ConfigError
from tasks.artifacts import project_config

FAILURE_FILE = "last_failure.md"
logger = logging.getLogger("grpo_dual.notify")


def failure_file(flow_run: FlowRun) -> Path:
    """``<project>/<runs_dir>/last_failure.md`` of the project the run was started on."""
    project = Path(flow_run.parameters.get("project_dir", ".")).resolve()
    try:
        runs = project_config(project).paths.runs_dir
    except (ConfigError, OSError):
        runs = "runs"
    return project / runs / FAILURE_FILE


def failure_report(flow_run: FlowRun, state: State) -> str:
    return "\n".join(
        [
            f"# full-retrain failed: flow run `{flow_run.name}`",
            "",
            f"- flow run id: `{flow_run.id}`",
            f"- parameters: `{flow_run.parameters}`",
            f"- state: {state.name} at {state.timestamp:%Y-%m-%d %H:%M:%S %Z}",
            "",
            "## Reason",
            "",
            "```",
            (state.message or "(no message)").strip(),
            "```",
            "",
            f"Logs: `prefect flow-run logs {flow_run.id}`; fix the cause, then rerun the flow or `dvc repro`.",
            "",
        ]
    )


def notify_failure(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """``on_failure`` hook: write the failure file and artifact, log it at ERROR."""
    text = failure_report(flow_run, state)
    path = failure_file(flow_run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    create_markdown_artifact(markdown=text, key="full-retrain-failure", description="Why the last run failed")
    logger.error("full-retrain run %s failed; the reason is in %s", flow_run.name, path)


def clear_failure(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """``on_completion`` hook: a successful run removes the last failure's file."""
    failure_file(flow_run).unlink(missing_ok=True)
