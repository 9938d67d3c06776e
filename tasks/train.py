"""Task ``grpo``: GRPO training (DVC stage ``grpo``, `grpo train`) with a live progress artifact."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.runtime import task_run
from prefect.states import State

from grpo import paths
from grpo.health.metrics import read_metrics
from tasks.artifacts import project_config, publish_metrics, publish_rows
from tasks.retry import RETRY_DELAY_S, retry_transient
from tasks.states import stage_result


class Progress:
    """The ``grpo-progress`` artifact, updated only when the run's last logged step changes."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        self.run_dir, self.steps, self.percent = run_dir, steps, 0.0
        self.id = create_progress_artifact(0.0, key="grpo-progress", description=f"GRPO steps of {steps}")

    def poll(self) -> bool:
        """Publish the percentage of steps done if it moved; True when an update was sent."""
        done = max(
            (record["step"] for record in read_metrics(paths.step_metrics_file(self.run_dir))), default=0
        )
        return self.set(100.0 * min(done, self.steps) / self.steps)

    def set(self, percent: float) -> bool:
        if percent == self.percent:
            return False
        update_progress_artifact(self.id, percent)
        self.percent = percent
        return True


def start_over(run_dir: Path) -> None:
    """A forced run trains from scratch: the run state it would resume from goes first (attempt 1 only)."""
    if run_dir.is_dir() and task_run.run_count <= 1:
        get_run_logger().warning(
            "force: removing %s (checkpoints, metrics, W&B files) to train from scratch", run_dir
        )
        shutil.rmtree(run_dir)


@task(name="grpo", retries=2, retry_delay_seconds=RETRY_DELAY_S, retry_condition_fn=retry_transient)
def train(project_dir: str, force: bool = False) -> State:
    """Run DVC stage ``grpo``; a retry resumes from the last checkpoint, a forced run starts from scratch."""
    cfg = project_config(project_dir)
    run_dir = Path(project_dir) / paths.run_dir(cfg)
    if force:
        start_over(run_dir)
    progress = Progress(run_dir, cfg.grpo.steps)
    state = stage_result("grpo", project_dir, force, poll=progress.poll)
    if not state.is_completed():
        return state
    progress.set(100.0)
    publish_metrics(
        Path(project_dir) / paths.metrics_file(cfg, "grpo"),
        "grpo-metrics",
        "GRPO summary (metrics/grpo.json)",
    )
    publish_rows(
        paths.entropy_history_file(run_dir, cfg.experiment), None, "entropy-curve", "Entropy per GRPO step"
    )
    return state
