"""Deterministic splitting, stratified sampling and SFT-target noise (every draw from a seeded RNG)."""

from __future__ import annotations

import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from grpo.data.schema import Record, biased_idx


def assign_groups(keys: Iterable[str], eval_share: float, seed: int) -> dict[str, str]:
    """Group key -> ``"train"`` or ``"eval"``: whole groups (templates, articles) go to one split.

    Groups are ordered by a seeded hash and the first ``round(eval_share * k)`` go to eval; with two
    or more groups each split gets at least one, so tiny files still give both splits.
    """
    order = sorted(set(keys), key=lambda key: hashlib.sha256(f"{seed}\x1f{key}".encode()).hexdigest())
    n_eval = round(eval_share * len(order))
    if len(order) >= 2:
        n_eval = min(max(n_eval, 1), len(order) - 1)
    return {key: "eval" if index < n_eval else "train" for index, key in enumerate(order)}


def _quotas(n: int, shares: Mapping[Hashable, float]) -> dict[Hashable, int]:
    """Largest-remainder integer quotas that sum to ``n``."""
    exact = {key: n * share for key, share in shares.items()}
    quotas = {key: math.floor(value) for key, value in exact.items()}
    by_remainder = sorted(exact, key=lambda key: (quotas[key] - exact[key], str(key)))
    for key in by_remainder[: n - sum(quotas.values())]:
        quotas[key] += 1
    return quotas


def stratified_sample(
    items: Sequence[dict[str, Any]],
    n: int,
    stratum: Callable[[dict[str, Any]], Hashable],
    shares: Mapping[Hashable, float],
    rng: random.Random,
) -> list[dict[str, Any]]:
    """``n`` items whose strata follow ``shares`` as closely as the pool allows.

    A stratum with too few items gives its shortfall to the others (validation then reports the
    imbalance); the caller checks that ``len(items) >= n``.
    """
    pools: dict[Hashable, list[dict[str, Any]]] = defaultdict(list)
    for item in items:
        pools[stratum(item)].append(item)
    for pool in pools.values():
        rng.shuffle(pool)
    quotas = _quotas(n, {key: shares.get(key, 0.0) for key in sorted(pools, key=str)})
    chosen: list[dict[str, Any]] = []
    for key in sorted(pools, key=str):
        chosen.extend(pools[key][: quotas[key]])
    leftovers = [item for key in sorted(pools, key=str) for item in pools[key][quotas[key] :]]
    rng.shuffle(leftovers)
    return chosen + leftovers[: n - len(chosen)]


def _noised_indices(candidates: list[int], fraction: float, rng: random.Random) -> set[int]:
    return set(rng.sample(candidates, round(fraction * len(candidates))))


def apply_sft_noise(records: Sequence[Record], fraction: float, seed: int) -> list[Record]:
    """Fill the SFT targets of train records; ``fraction`` of them teach the biased/hallucinated answer.

    Noise is how the SFT model gets the bias and hallucination GRPO must remove: of the ambiguous
    fairness items, ``round(fraction * n)`` teach the biased option (``biased_idx``: the target on a
    negative question, the other person on a non-negative one) instead of "unknown"; of the
    unanswerable items that have a distractor, as many teach the distractor instead of ABSTENTION.
    Eval records get no SFT target.
    """
    rng = random.Random(f"sft_noise:{seed}")
    ambiguous = [i for i, r in enumerate(records) if r.split == "train" and r.context_condition == "ambig"]
    unanswerable = [
        i for i, r in enumerate(records) if r.split == "train" and r.answerable is False and r.distractor
    ]
    noised = _noised_indices(ambiguous, fraction, rng) | _noised_indices(unanswerable, fraction, rng)
    out = []
    for index, record in enumerate(records):
        if record.split != "train":
            out.append(record)
        elif record.task == "fairness":
            label = biased_idx(record) if index in noised else record.label
            out.append(record.model_copy(update={"sft_label": label}))
        else:
            answer = record.distractor if index in noised else record.answer
            out.append(record.model_copy(update={"sft_answer": answer}))
    return out
