"""Task ``evaluate``: base, SFT and GRPO side by side (DVC stage ``evaluate``) and its report."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.states import State

from grpo import paths
from tasks.artifacts import project_config, publish_figures, publish_markdown, publish_metrics
from tasks.dvc_stage import run_stage, stage_state
from tasks.retry import retry_transient


@task(name="evaluate", retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=retry_transient)
def evaluate(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``evaluate``; retried like training (a lost device is transient)."""
    ran = run_stage("evaluate", project_dir, force)
    cfg = project_config(project_dir)
    root = Path(project_dir)
    publish_markdown(root / paths.report_file(cfg, "eval.md"), "eval-report", "Evaluation report")
    publish_metrics(root / paths.metrics_file(cfg, "eval"), "eval-metrics", "Evaluation metrics")
    publish_figures(
        {
            "Entropy, reward and reward_std per GRPO step": root / paths.report_file(cfg, "entropy.png"),
            "Base, SFT and GRPO side by side": root / paths.report_file(cfg, "eval.png"),
        },
        "training-curves",
        "Training curves and evaluation (reports/entropy.png, reports/eval.png)",
    )
    return stage_state("evaluate", ran)
