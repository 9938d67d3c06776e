"""Rewards as plain functions ``(completion_text, example) -> float`` and a name -> function dict.

The task name of a record picks its reward; ``rewards.weights.<task>`` in params scales it and
``rewards.abstain_when_answered.<task>`` sets what "unknown" / abstaining earns where the context answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.core.advantages import per_row
from grpo.errors import GrpoError
from grpo.rewards.fairness import FairnessOutcome, fairness_outcome, fairness_reward, parse_choice
from grpo.rewards.hallucination import HallucinationOutcome, hallucination_outcome, hallucination_reward
from grpo.rewards.text import exact_match, f1_score, is_abstention, normalize_answer

REWARDS: dict[str, Callable[..., float]] = {
    "fairness": fairness_reward,
    "hallucination": hallucination_reward,
}
"""Reward function of each task: ``(completion, example[, reward of abstaining where the context answers])``."""


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


def weighted_reward(task: str, completion: str, example: dict, rewards: Mapping[str, float] | Any) -> float:
    """``weight * REWARDS[task](completion, example, abstain)``. ``rewards``: the params section ``rewards``
    (its ``weights`` and ``abstain_when_answered``), or the weights alone (a mapping or the
    ``rewards.weights`` section: abstaining where the context answers then earns the reward table's)."""
    if task not in REWARDS:
        raise UnknownTaskError(f"no reward for task {task!r}: the known tasks are {sorted(REWARDS)}")
    abstain = getattr(rewards, "abstain_when_answered", None)
    weights = getattr(rewards, "weights", rewards)
    extra = () if abstain is None else (float(getattr(abstain, task)),)
    return _weight(task, weights) * REWARDS[task](completion, example, *extra)


def group_rewards(
    completions: Sequence[str], examples: Sequence[dict], group_size: int, rewards: Mapping[str, float] | Any
) -> list[float]:
    """``weighted_reward`` of every completion of a rollout: completion ``i`` answers ``examples[i // group_size]``."""
    rows = per_row(examples, group_size)
    return [
        weighted_reward(example["task"], text, example, rewards)
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
