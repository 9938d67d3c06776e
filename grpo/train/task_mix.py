"""Which prompts a GRPO step trains on: both tasks in every batch, in the configured ratio."""

from __future__ import annotations

import random

from grpo.data.schema import TASKS
from grpo.data.select import interleave
from grpo.errors import GrpoError
from grpo.seeding import derive_seed


def task_counts(n_prompts: int, fairness_fraction: float) -> dict[str, int]:
    """Prompts per task; both tasks get at least one when the fraction is strictly between 0 and 1."""
    n_fair = round(n_prompts * fairness_fraction)
    if 0.0 < fairness_fraction < 1.0 and n_prompts >= 2:
        n_fair = min(max(n_fair, 1), n_prompts - 1)
    return {"fairness": n_fair, "hallucination": n_prompts - n_fair}


def sample_step(
    by_task: dict[str, list[dict]], n_prompts: int, fairness_fraction: float, seed: int, step: int
) -> list[dict]:
    """The prompts of ``step``: a pure function of (seed, step), so a resumed run sees the same ones.

    Tasks are interleaved (f, h, f, h, ...) so any strided shard across processes holds both.
    """
    rng = random.Random(derive_seed(seed, ("step", step)))
    picked: dict[str, list[dict]] = {}
    for task, count in task_counts(n_prompts, fairness_fraction).items():
        pool = by_task.get(task, [])
        if count and not pool:
            raise GrpoError(
                f"grpo: the training data has no {task!r} records but grpo.fairness_fraction="
                f"{fairness_fraction} asks for {count} per step; fix the data or the fraction"
            )
        picked[task] = [pool[rng.randrange(len(pool))] for _ in range(count)]
    return interleave([picked[task] for task in TASKS])
