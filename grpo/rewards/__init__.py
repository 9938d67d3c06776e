"""Rewards as plain functions ``(completion_text, example) -> float`` and a name -> function dict.

The task name of a record picks its reward; ``rewards.weights.<task>`` in params scales it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.core.advantages import per_row
from grpo.errors import GrpoError
from grpo.rewards.fairness import FairnessOutcome, fairness_outcome, fairness_reward, parse_choice
from grpo.rewards.hallucination import HallucinationOutcome, hallucination_outcome, hallucination_reward
from grpo.rewards.text import exact_match, f1_score, is_abstention, normalize_answer

REWARDS: dict[str, Callable[[str, dict], float]] = {
    "fairness": fairness_reward,
    "hallucination": hallucination_reward,
}
"""Reward function of each task."""


class UnknownTaskError(GrpoError, KeyError):
    """A record names a task that has no reward function or no weight."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def _weight(task: str, weights: Mapping[str, float] | Any) -> float:
    value = weights.get(task) if isinstance(weights, Mapping) else getattr(weights, task, None)
    if value is None:
        raise UnknownTaskError(
            f"rewards.weights has no weight for task {task!r}: add rewards.weights.{task} to params.yaml"
        )
    return float(value)


def weighted_reward(task: str, completion: str, example: dict, weights: Mapping[str, float] | Any) -> float:
    """``weights[task] * REWARDS[task](completion, example)``; ``weights`` is a mapping or the params section."""
    if task not in REWARDS:
        raise UnknownTaskError(f"no reward for task {task!r}: the known tasks are {sorted(REWARDS)}")
    return _weight(task, weights) * REWARDS[task](completion, example)


def group_rewards(
    completions: Sequence[str], examples: Sequence[dict], group_size: int, weights: Mapping[str, float] | Any
) -> list[float]:
    """``weighted_reward`` of every completion of a rollout: completion ``i`` answers ``examples[i // group_size]``."""
    rows = per_row(examples, group_size)
    return [
        weighted_reward(example["task"], text, example, weights)
        for text, example in zip(completions, rows, strict=True)
    ]


__all__ = [
    "REWARDS",
    "FairnessOutcome",
    "HallucinationOutcome",
    "UnknownTaskError",
    "exact_match",
    "f1_score",
    "fairness_outcome",
    "fairness_reward",
    "group_rewards",
    "hallucination_outcome",
    "hallucination_reward",
    "is_abstention",
    "normalize_answer",
    "parse_choice",
    "weighted_reward",
]
