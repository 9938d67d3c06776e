"""``rewards``: the weight of each task's reward (``grpo/rewards/``)."""

from __future__ import annotations

from pydantic import Field

from grpo.config.base import Section


class RewardWeights(Section):
    fairness: float = 1.0
    """Multiplier of the fairness reward (grpo.rewards.fairness)."""
    hallucination: float = 1.0
    """Multiplier of the hallucination reward (grpo.rewards.hallucination)."""


class RewardsConfig(Section):
    weights: RewardWeights = Field(default_factory=RewardWeights)
    """Per-task reward multipliers."""
