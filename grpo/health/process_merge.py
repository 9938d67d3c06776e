"""One step's metrics over several processes: each process measures its own rows, these merge them into
the global batch's (``grpo/train/collectives.py`` gathers them; ``merge_process_metrics``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from grpo.data.schema import TASKS
from grpo.health.kinds import KIND_MEANS
from grpo.health.metrics import MetricsError

# Metrics that describe one process's rows, and how the processes' values combine into the global
# batch's: a mean weighted by the count named (``groups``: prompts of the first draw, ``rows``: trained
# completions, ``rows/<task>``: first-draw completions of the task), or min/max/sum. Every other metric
# is computed from all-reduced gradients and losses and is the same on every process.
PROCESS_MEANS = {
    "reward": "groups",
    "reward_std": "groups",
    "frac_reward_zero_std": "groups",
    "advantages/abs_mean": "groups",
    "completions/mean_length": "rows",
    "completions/clipped_ratio": "rows",
    "eos_suppressed_frac": "rows",
    **{f"rewards/{task}/mean": f"rows/{task}" for task in TASKS},
    **KIND_MEANS,  # kinds/<kind>/reward|abstention over rows/<kind>
}
PROCESS_EXTREMES = {
    "completions/min_length": min,
    "completions/max_length": max,
    "step_time": max,
    "dynamic/draws": max,
    "dynamic/kept_groups": sum,
}


def _weighted(values: Sequence[tuple[float, float]]) -> float | None:
    """Mean of (value, weight) pairs; None when no weight."""
    total = sum(w for _, w in values)
    return sum(v * w for v, w in values) / total if total else None


def merge_process_metrics(
    metrics: Sequence[Mapping[str, Any]], counts: Sequence[Mapping[str, float]]
) -> dict[str, Any]:
    """One step's metrics of the global batch from each process's ``metrics`` and ``counts``.

    Means are weighted by each process's count (see ``PROCESS_MEANS``); ``rewards/<task>/std`` is the
    pooled population std; ``tokens_per_s`` is all processes' tokens over the slowest one's time.
    """
    if len(metrics) != len(counts) or not metrics:
        raise MetricsError(
            f"merge_process_metrics needs one counts per metrics (got {len(metrics)}, {len(counts)})"
        )
    merged = dict(metrics[0])
    for key, count in PROCESS_MEANS.items():
        pairs = [
            (float(m[key]), float(c.get(count, 0))) for m, c in zip(metrics, counts, strict=True) if key in m
        ]
        value = _weighted(pairs)
        if value is not None:
            merged[key] = value
    for key, pick in PROCESS_EXTREMES.items():
        if all(key in m for m in metrics):
            merged[key] = pick(float(m[key]) for m in metrics)
    for task in TASKS:
        mean, std, count = f"rewards/{task}/mean", f"rewards/{task}/std", f"rows/{task}"
        pairs = [
            (float(m[std]) ** 2 + float(m[mean]) ** 2, float(c.get(count, 0)))
            for m, c in zip(metrics, counts, strict=True)
            if std in m and mean in m
        ]
        second = _weighted(pairs)
        if second is not None:
            merged[std] = math.sqrt(max(second - merged[mean] ** 2, 0.0))
    if all("tokens_per_s" in m and "step_time" in m for m in metrics):
        tokens = sum(float(m["tokens_per_s"]) * float(m["step_time"]) for m in metrics)
        merged["tokens_per_s"] = tokens / max(merged["step_time"], 1e-9)
    return merged
