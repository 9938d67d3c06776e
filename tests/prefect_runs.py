"""Read back what a flow run did through the Prefect API: its task runs and its artifacts."""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import TaskRun

ARTIFACT_KEYS = {
    "validation-report", "sft-metrics", "preflight-checks", "grpo-progress", "grpo-metrics", "entropy-curve",
    "eval-report", "eval-metrics", "training-curves",
}
"""Artifacts a completed full-retrain run publishes (tasks/*.py)."""


def task_runs(client: SyncPrefectClient, flow_run_id: UUID) -> dict[str, TaskRun]:
    """``{task name: task run}`` of one flow run (task run names are ``<task>-<suffix>``)."""
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run for run in runs}


def artifact_keys(client: SyncPrefectClient, flow_run_id: UUID) -> set[str]:
    """Keys of the artifacts one flow run published."""
    found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {artifact.key for artifact in found if artifact.key}
