"""Per-step health metrics: their names, small helpers that compute some, and one writer for all sinks.

Every step's metrics go to ``run_dir/metrics.jsonl`` (one line per step), to W&B (offline by
default, files under ``run_dir/wandb``) and, for entropy, to ``run_dir/entropy_history_<experiment>.json``
(DESIGN.md "Health"). Names follow TRL where TRL has one, so curves read like the ones users know.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.data.schema import TASKS
from grpo.errors import GrpoError
from grpo.files import write_text
from grpo.paths import entropy_history_file, step_metrics_file

HEALTH_METRICS = (
    "reward",
    "reward_std",
    *(f"rewards/{task}/{stat}" for task in TASKS for stat in ("mean", "std")),
    "frac_reward_zero_std",
    "entropy",
    "policy/entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "eos_suppressed_frac",
    "logits/max",
    "logits/top1_gap",
    "logits/top5_mass",
    *(f"grad_norm/{task}" for task in TASKS),
    "grad_cos",
    "cagrad/weights",
    "step_time",
    "tokens_per_s",
)
"""Every metric DESIGN.md "Health" asks the trainer to record each step."""

WANDB_MODES = ("disabled", "offline", "online")  # from strictest to least strict
_ENV_MODES = {
    "disabled": "disabled",
    "offline": "offline",
    "dryrun": "offline",
    "online": "online",
    "run": "online",
}


class MetricsError(GrpoError):
    """A metric value cannot be recorded, or steps are logged out of order."""


# --------------------------------------------------------------------------- helpers


def completion_stats(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """``completions/*`` metrics from completion lengths ``[N]`` (tokens) and ``truncated`` ``[N]`` bool.

    ``truncated`` is True where a completion hit ``max_new_tokens`` without an end token.
    """
    if lengths.ndim != 1 or lengths.shape != truncated.shape or lengths.numel() == 0:
        raise MetricsError(
            f"completion_stats needs lengths [N] and truncated [N] with N > 0 "
            f"(got {tuple(lengths.shape)} and {tuple(truncated.shape)})"
        )
    lengths = lengths.float()
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
    }


def mean_content_length(metrics: Mapping[str, Any]) -> float | None:
    """Mean tokens of content per completion, the stop token not counted; None when
    ``completions/mean_length`` or ``completions/clipped_ratio`` is absent.

    ``completions/mean_length`` counts the stop token that ends every completion that stopped
    (``batching.completion_mask``), so a batch of empty answers reads 1.0, never 0; only the clipped
    rows hold no stop token. Both are row means (merged over processes by rows), so
    ``mean_length - (1 - clipped_ratio)`` is exactly the mean count of content tokens.
    """
    length, clipped = metrics.get("completions/mean_length"), metrics.get("completions/clipped_ratio")
    if length is None or clipped is None:
        return None
    return float(length) - (1.0 - float(clipped))


def task_reward_stats(rewards: torch.Tensor, tasks: Sequence[str]) -> dict[str, float]:
    """``rewards/<task>/mean|std`` over the rows of each task present; ``rewards`` is ``[N]``.

    The std is the population std (no Bessel correction) so a task with one row reports 0, not NaN.
    """
    if rewards.ndim != 1 or rewards.shape[0] != len(tasks):
        raise MetricsError(
            f"task_reward_stats needs rewards [N] and N task names (got {tuple(rewards.shape)}, {len(tasks)})"
        )
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise MetricsError(f"task_reward_stats: unknown tasks {unknown}; the tasks are {list(TASKS)}")
    stats = {}
    for task in TASKS:
        rows = rewards[torch.tensor([t == task for t in tasks], dtype=torch.bool)].float()
        if rows.numel():
            stats[f"rewards/{task}/mean"] = rows.mean().item()
            stats[f"rewards/{task}/std"] = rows.std(correction=0).item()
    return stats


def _jsonable(key: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        value = value.tolist() if getattr(value, "ndim", 0) else value.item()
    if isinstance(value, list | tuple):
        return [_jsonable(key, item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise MetricsError(
        f"metric {key!r} has type {type(value).__name__}: log numbers, lists of numbers or strings"
    )


def _for_wandb(record: Mapping[str, Any]) -> dict[str, Any]:
    """Lists such as ``cagrad/weights`` become ``cagrad/weights/0``, ``/1``: W&B charts scalars."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat.update({f"{key}/{i}": item for i, item in enumerate(value)})
        else:
            flat[key] = value
    return flat


def effective_wandb_mode(configured: str, env: str | None) -> str:
    """The stricter of params ``tracking.wandb`` and ``WANDB_MODE`` (disabled < offline < online).

    An offline machine can force ``WANDB_MODE=offline`` over params, and params ``disabled`` is never
    overridden into writing.
    """
    modes = [configured]
    if env:
        if env.lower() not in _ENV_MODES:
            raise MetricsError(f"WANDB_MODE={env!r} is not one of {sorted(_ENV_MODES)}: fix the environment")
        modes.append(_ENV_MODES[env.lower()])
    return min(modes, key=WANDB_MODES.index)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a per-step ``metrics.jsonl`` (the one reader of that file; absent file: ``[]``).

    Blank lines are skipped, and so is a last line that is not valid JSON: a run killed while writing
    leaves one cut line at the end, and the steps before it are still good. A bad line anywhere else
    is an error naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            if number != len(lines):
                raise MetricsError(
                    f"{path}: line {number} is not valid JSON ({exc}): {line[:80]!r}; only the last line "
                    "may be cut short (by a killed run), so this file was edited or corrupted"
                ) from None
    return records


# --------------------------------------------------------------------------- writer


def _record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The JSONL record of one step: JSON values, entropy under both of its names."""
    record = {"step": step, **{key: _jsonable(key, value) for key, value in metrics.items()}}
    # TRL logs entropy under both names; dashboards built for either keep working.
    for name, twin in (("entropy", "policy/entropy"), ("policy/entropy", "entropy")):
        if name in record and twin not in record:
            record[twin] = record[name]
    return record


def _kept_prefix(path: Path, resume_step: int) -> tuple[int, list[dict[str, Any]]]:
    """The byte length and records of the longest run of whole lines at the start of ``path`` whose
    steps increase and are <= ``resume_step`` (what a resume keeps of the file)."""
    if not path.is_file():
        return 0, []
    kept, length, last = [], 0, 0
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None  # a line cut by a kill: dropped
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or not last < step <= resume_step:
            break
        kept.append(record)
        length, last = length + len(line), record["step"]
    return length, kept


class MetricsWriter:
    """Writes each step's metrics to JSONL, W&B and the entropy history; only on the main process.

    The JSONL file is append-only: ``resume_step=None`` (or 0) starts it empty; ``resume_step=k`` keeps
    the lines of steps <= k already on disk (the steps the checkpoint of step k saw), cuts the file
    after them in place (never rewriting them) and appends from ``restored`` (the checkpoint's own
    history) every step <= k the file lacks, so a resume never drops a step the checkpoint holds and a
    resumed run has exactly one line per step. Steps must increase: a second entry for a step is an error.
    """

    def __init__(
        self,
        run_dir: str | Path,
        experiment: str,
        tracking_cfg: Any,
        config_dict: Mapping[str, Any],
        is_main_process: bool = True,
        resume_step: int | None = None,
        restored: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.run_dir, self.experiment, self.active = Path(run_dir), experiment, is_main_process
        self.jsonl_path = step_metrics_file(self.run_dir)
        self.entropy_path = entropy_history_file(self.run_dir, experiment)
        self.history: list[dict[str, Any]] = []
        self._entropy: list[dict[str, Any]] = []
        self._file = None
        self._run = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        length, self.history = _kept_prefix(self.jsonl_path, resume_step or 0)
        self._file = open(self.jsonl_path, "a", encoding="utf-8")  # closed in close()
        self._file.truncate(length)  # in place: the lines kept are never rewritten
        done = self.last_step or 0
        for entry in restored:
            if done < entry["step"] <= (resume_step or 0):
                self._append(_record(entry["step"], {k: v for k, v in entry.items() if k != "step"}))
        self._entropy = [{"step": r["step"], "entropy": r["entropy"]} for r in self.history if "entropy" in r]
        write_text(self.entropy_path, json.dumps(self._entropy, indent=1))
        self.wandb_mode = effective_wandb_mode(tracking_cfg.wandb, os.environ.get("WANDB_MODE"))
        if self.wandb_mode != "disabled":
            self._run = self._start_wandb(tracking_cfg.project, dict(config_dict))

    def _start_wandb(self, project: str, config: dict[str, Any]):
        if self.wandb_mode == "offline":
            # W&B's own telemetry is on by default and an offline *run* does not switch it off: the process's
            # OpenTelemetry exporter probes the W&B host (DNS, then HTTPS) unless the process-wide settings
            # are offline, and the service reports its errors to Sentry. Off before W&B starts anything.
            os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb  # imported here: a disabled run never pays for it

        if self.wandb_mode == "offline":
            wandb.setup(settings=wandb.Settings(mode="offline"))
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_job_creation=True)
        return wandb.init(
            project=project,
            name=self.experiment,
            dir=str(self.run_dir),
            mode=self.wandb_mode,
            config=config,
            reinit="create_new",
            settings=settings,
        )

    @property
    def last_step(self) -> int | None:
        """The last step recorded (after a resume: the checkpoint's step)."""
        return self.history[-1]["step"] if self.history else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step: a JSONL line (flushed), a W&B row, and the rewritten entropy history."""
        if not self.active:
            return
        if self.last_step is not None and step <= self.last_step:
            raise MetricsError(
                f"metrics for step {step} logged after step {self.last_step}: log each step once, in "
                "order; a resumed run passes resume_step=<checkpoint step> to MetricsWriter"
            )
        record = _record(step, metrics)
        self._append(record)
        if self._run is not None:
            self._run.log(_for_wandb({k: v for k, v in record.items() if k != "step"}), step=step)
        entropy = record.get("entropy")
        if isinstance(entropy, int | float):
            # null, not NaN: the history file stays standard JSON and keeps one entry per step
            self._entropy.append({"step": step, "entropy": entropy if math.isfinite(entropy) else None})
            write_text(self.entropy_path, json.dumps(self._entropy, indent=1))

    def _append(self, record: dict[str, Any]) -> None:
        """One JSONL line, flushed, and the record in ``history``."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.history.append(record)

    def close(self) -> None:
        """Close the JSONL file and finish the W&B run (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._run is not None:
            import wandb

            self._run.finish()
            # finish() returns before the W&B service has flushed and closed the run's .wandb file
            # (it only informs the service); teardown waits for the service to exit, so the run
            # files are complete when close() returns (DVC and the tests read them right after).
            wandb.teardown()
            self._run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
