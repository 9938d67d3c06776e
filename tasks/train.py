"""Task ``grpo``: GRPO training (DVC stage ``grpo``, `grpo train`) with a live progress artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from grpo import paths
from grpo.health.metrics import read_metrics
from tasks.artifacts import project_config, publish_metrics, publish_rows
from tasks.dvc_stage import run_stage


@task(name="grpo", retries=2, retry_delay_seconds=[30, 120])
def train(project_dir: str, force: bool = False) -> bool:
    """Run DVC stage ``grpo``; retried, and a retry resumes from the last checkpoint (the trainer's own)."""
    cfg = project_config(project_dir)
    run_dir = Path(project_dir) / paths.run_dir(cfg)
    progress = create_progress_artifact(0.0, key="grpo-progress", description=f"GRPO steps of {cfg.grpo.steps}")

    def poll() -> None:
        steps = [record["step"] for record in read_metrics(paths.step_metrics_file(run_dir))] if run_dir.is_dir() else []
        update_progress_artifact(progress, 100.0 * max(steps, default=0) / cfg.grpo.steps)

    ran = run_stage("grpo", project_dir, force, poll=poll)
    update_progress_artifact(progress, 100.0)
    publish_metrics(Path(project_dir) / paths.metrics_file(cfg, "grpo"), "grpo-metrics", "GRPO summary (metrics/grpo.json)")
    publish_rows(paths.entropy_history_file(run_dir, cfg.experiment), None, "entropy-curve", "Entropy per GRPO step")
    return ran
