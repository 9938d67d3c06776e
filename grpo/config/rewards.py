"""``rewards``: the weight of each task's reward (``grpo/rewards/``)."""

from __future__ import annotations

from pydantic import Field

from grpo.config.base import Section


class RewardWeights(Section):
    fairness: float = 1.0
    """Multiplier of the fairness reward (grpo.rewards.fairness)."""
    hallucination: float = 1.0
    """Multiplier of the hallucination reward (grpo.rewards.hallucination)."""


class AbstainRewards(Section):
    fairness: float = Field(-0.5, ge=-1.0, le=1.0)
    """Reward of the "unknown" option on a disambiguated item (the context names the person), in [-1, 1]:
    between a wrong person (-1) and the right one (+1); the lower, the less "unknown" everywhere pays."""
    hallucination: float = Field(-0.5, ge=-1.0, le=1.0)
    """Reward of an abstention on an answerable question (the context holds the answer), in [-1, 1]:
    between a wrong answer (-1) and the right one (+1)."""


class RewardsConfig(Section):
    weights: RewardWeights = Field(default_factory=RewardWeights)
    """Per-task reward multipliers."""
    abstain_when_answered: AbstainRewards = Field(default_factory=AbstainRewards)
    """Per-task reward of "unknown" / abstaining where the context answers (before the weight)."""
