"""Task ``evaluate``: base, SFT and GRPO side by side (DVC stage ``evaluate``) and its report."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.states import State

from grpo import paths
from grpo.eval.keymetrics import key_metrics_path, read_key_metrics
from tasks.artifacts import cell, project_config, publish_figures, publish_markdown, publish_text
from tasks.reports import eval_markdown
from tasks.retry import RETRY_DELAY_S, retry_transient
from tasks.states import stage_result


@task(name="evaluate", retries=2, retry_delay_seconds=RETRY_DELAY_S, retry_condition_fn=retry_transient)
def evaluate(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``evaluate``; retried like training (a lost device is transient).

    Artifacts: ``eval-report`` (the verdict and every kind of item's row when the report has them, then
    the headline), ``eval-details`` (``reports/eval.md`` whole), ``eval-metrics`` (the key rows per
    model, as ``dvc metrics show`` has them) and ``training-curves``.
    """
    state = stage_result("evaluate", project_dir, force)
    if not state.is_completed():
        return state
    cfg = project_config(project_dir)
    root = Path(project_dir)
    report = root / paths.report_file(cfg, "eval.md")
    if report.is_file():
        details = f"The full report: the `eval-details` artifact, `{report}`."
        publish_text(eval_markdown(report.read_text(encoding="utf-8"), details), "eval-report", "Evaluation")
    publish_markdown(report, "eval-details", "Evaluation report in full (reports/eval.md)")
    rows = read_key_metrics(root / key_metrics_path(cfg, "evaluate"))
    create_table_artifact(
        table=[
            {
                "metric": name,
                **{k: cell(v) for k, v in (row if isinstance(row, dict) else {"value": row}).items()},
            }
            for name, row in rows.items()
        ],
        key="eval-metrics",
        description="Key evaluation rows, greedy (metrics/key/evaluate/)",
    )
    publish_figures(
        {
            "Entropy, reward and reward_std per GRPO step": root / paths.report_file(cfg, "entropy.png"),
            "Base, SFT and GRPO side by side": root / paths.report_file(cfg, "eval.png"),
        },
        "training-curves",
        "Training curves and evaluation (reports/entropy.png, reports/eval.png)",
    )
    return state
