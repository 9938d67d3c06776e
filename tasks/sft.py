"""Task ``sft``: supervised fine-tuning (DVC stage ``sft``) and its metrics table."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_metrics
from tasks.dvc_stage import run_stage, stage_state
from tasks.retry import retry_transient


@task(name="sft", retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=retry_transient)
def sft(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``sft``; retried: a lost GPU or an OOM from a neighbour is transient."""
    ran = run_stage("sft", project_dir, force)
    metrics = Path(project_dir) / paths.metrics_file(project_config(project_dir), "sft")
    publish_metrics(metrics, "sft-metrics", "SFT summary (metrics/sft.json)")
    return stage_state("sft", ran)
