"""Task ``sft``: supervised fine-tuning (DVC stage ``sft``) and its metrics table."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_metrics
from tasks.retry import RETRY_DELAY_S, retry_transient
from tasks.states import stage_result


@task(name="sft", retries=2, retry_delay_seconds=RETRY_DELAY_S, retry_condition_fn=retry_transient)
def sft(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``sft``; retried: a lost GPU or an OOM from a neighbour is transient."""
    state = stage_result("sft", project_dir, force)
    if state.is_completed():
        metrics = Path(project_dir) / paths.metrics_file(project_config(project_dir), "sft")
        publish_metrics(metrics, "sft-metrics", "SFT summary (metrics/sft.json)")
    return state
