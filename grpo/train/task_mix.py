"""Which prompts a GRPO step trains on: both tasks in every batch, in the configured ratio, and (with
``grpo.kind_share``) each task's kinds of item in a set share."""

from __future__ import annotations

import random
from collections.abc import Sequence

from grpo.data.kinds import ANSWERED_KINDS, KINDS, record_kind
from grpo.data.schema import TASKS
from grpo.data.select import interleave
from grpo.errors import GrpoError
from grpo.seeding import derive_seed


def split_count(n: int, share: float) -> tuple[int, int]:
    """``n`` split into ``(round(n * share), rest)``; both parts get at least one when the share is strictly
    between 0 and 1 and ``n >= 2``."""
    first = round(n * share)
    if 0.0 < share < 1.0 and n >= 2:
        first = min(max(first, 1), n - 1)
    return first, n - first


def task_counts(n_prompts: int, fairness_fraction: float) -> dict[str, int]:
    """Prompts per task; both tasks get at least one when the fraction is strictly between 0 and 1."""
    n_fair, n_hall = split_count(n_prompts, fairness_fraction)
    return {"fairness": n_fair, "hallucination": n_hall}


def _kind_balanced(
    task: str, pool: list[dict], count: int, kind_share: float, rng: random.Random
) -> list[dict]:
    """``count`` records of ``pool`` (one task's), ``kind_share`` of them of the kind whose context answers
    (``ANSWERED_KINDS``), the rest of the other kind, each drawn uniformly within its kind, then shuffled."""
    answered, other = split_count(count, kind_share)
    picked = []
    for wanted, n in ((True, answered), (False, other)):
        kind_pool = [r for r in pool if (record_kind(r) in ANSWERED_KINDS) == wanted]
        if n and not kind_pool:
            kind = next(k for k in KINDS[task] if (k in ANSWERED_KINDS) == wanted)
            raise GrpoError(
                f"grpo: the training data has no {kind} {task} records but grpo.kind_share={kind_share} asks "
                f"for {n} per step; fix the data, or set grpo.kind_share to null (draw as the data falls)"
            )
        picked += [kind_pool[rng.randrange(len(kind_pool))] for _ in range(n)]
    rng.shuffle(picked)
    return picked


def sample_step(
    by_task: dict[str, list[dict]],
    n_prompts: int,
    fairness_fraction: float,
    seed: int,
    step: int,
    kind_share: float | None = None,
) -> list[dict]:
    """The prompts of ``step``: a pure function of (seed, step), so a resumed run sees the same ones.

    Tasks are interleaved (f, h, f, h, ...); ``shard_indices`` splits them across processes.
    ``kind_share`` (``grpo.kind_share``): the share of each task's prompts whose context answers
    (disambiguated, answerable); None draws each task's prompts uniformly from its pool.
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
        if kind_share is None:
            picked[task] = [pool[rng.randrange(len(pool))] for _ in range(count)]
        else:
            picked[task] = _kind_balanced(task, pool, count, kind_share, rng)
    return interleave([picked[task] for task in TASKS])


def shard_indices(tasks: Sequence[str], process_index: int, num_processes: int) -> list[int]:
    """Positions (in order) of the prompts process ``process_index`` trains on; ``tasks`` is the task of
    each prompt of the global batch.

    Each task's prompts are dealt round-robin and the deal goes on from one task to the next, so every
    process holds its share of each task and of the whole batch, within one prompt. A plain stride
    would not: ``[f, h, f, h, f, h, f, h]`` on 2 processes gives ``[f, f, f, f]`` and ``[h, h, h, h]``.
    """
    if not 0 <= process_index < num_processes:
        raise GrpoError(f"shard_indices: process {process_index} of {num_processes} does not exist")
    if num_processes > len(tasks):
        raise GrpoError(
            f"grpo: {len(tasks)} prompts per step cannot feed {num_processes} processes; set "
            f"grpo.prompts_per_step >= {num_processes} in params.yaml or start fewer processes"
        )
    mine, dealt = [], 0
    for task in dict.fromkeys(tasks):  # tasks in order of first appearance
        for position, this in enumerate(tasks):
            if this == task:
                if dealt % num_processes == process_index:
                    mine.append(position)
                dealt += 1
    return sorted(mine)


def shard(records: Sequence[dict], process_index: int, num_processes: int) -> list[dict]:
    """The records of ``shard_indices``: this process's share of the global batch."""
    return [records[i] for i in shard_indices([r["task"] for r in records], process_index, num_processes)]
