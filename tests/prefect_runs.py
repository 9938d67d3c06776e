"""Read back what a flow run did through the Prefect API: its task runs and its artifacts."""

from __future__ import annotations

import json
import re
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import TaskRun

from tasks.markdown import width_problems

ARTIFACT_KEYS = {
    "validation-report", "sft-metrics", "preflight-checks", "preflight-details", "grpo-progress", "grpo-metrics",
    "entropy-curve", "eval-report", "eval-details", "eval-metrics", "training-curves",
}
"""Artifacts a completed full-retrain run publishes (tasks/*.py)."""


def task_runs(client: SyncPrefectClient, flow_run_id: UUID) -> dict[str, TaskRun]:
    """``{task name: task run}`` of one flow run (task runs are named ``<task>-<suffix>``, and a stage's
    is renamed ``<stage>: <state>`` when it ends: tasks/states.py)."""
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {re.match(r"[a-z_]+", run.name).group(0): run for run in runs}


def artifacts(client: SyncPrefectClient, flow_run_id: UUID) -> list:
    return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def artifact_keys(client: SyncPrefectClient, flow_run_id: UUID) -> set[str]:
    """Keys of the artifacts one flow run published."""
    return {artifact.key for artifact in artifacts(client, flow_run_id) if artifact.key}


def as_markdown(artifact) -> str:
    """What the UI lays out for an artifact: its markdown, or a table artifact's rows as a markdown table."""
    if artifact.type != "table":
        return artifact.data if isinstance(artifact.data, str) else ""
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")).replace("|", "\\|") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def width_report(client: SyncPrefectClient, flow_run_id: UUID) -> dict[str, list[str]]:
    """``{artifact key: width problems}`` of every markdown and table artifact of the run ({} when all fit)."""
    found = {a.key: width_problems(as_markdown(a)) for a in artifacts(client, flow_run_id) if a.type != "progress"}
    return {key: problems for key, problems in found.items() if problems}
