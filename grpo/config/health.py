"""``monitor`` and ``tracking``: the health rules over GRPO's per-step metrics, and W&B (``grpo/health/``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo.config.base import Section


class TrackingConfig(Section):
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; the environment's WANDB_MODE wins when it is stricter (disabled < offline < online)."""
    project: str = "grpo-dual"
    """W&B project name (the run name is ``experiment``)."""


class RuleConfig(Section):
    threshold: float
    """The value at which the rule fires (its direction is given in the rule's description)."""
    window: int = Field(1, ge=1)
    """Consecutive steps the condition must hold before the rule fires."""
    action: Literal["warn", "stop", "off"] = "stop"
    """warn: log and go on; stop: raise TrainingStopped with a diagnosis; off: never check."""


def _rule(threshold: float, window: int = 1, action: str = "stop") -> Any:
    return Field(default_factory=lambda: RuleConfig(threshold=threshold, window=window, action=action))


class MonitorConfig(Section):
    boundary_steps: int = Field(3, ge=0)
    """Steps (counted from the first) whose completions are checked for a broken chat boundary."""
    boundary_header: RuleConfig = _rule(0.25)
    """Boundary: fires when the share of completions holding a chat-header token exceeds threshold (a template bug puts one in nearly every completion; a small model sampling at T=1 emits a stray one now and then)."""
    boundary_end_of_turn: RuleConfig = _rule(1.0)
    """Boundary: fires when a completion holds more end-of-turn tokens than threshold."""
    boundary_prompt_echo: RuleConfig = _rule(20.0)
    """Boundary: fires when a completion begins with the first threshold characters of its user message."""
    boundary_empty: RuleConfig = _rule(1.0)
    """Boundary: fires when the mean content length (tokens, the stop token not counted) is below threshold."""
    boundary_clipped: RuleConfig = _rule(0.95, action="warn")
    """Boundary: fires when completions/clipped_ratio exceeds threshold (the model never stops)."""
    boundary_entropy_low: RuleConfig = _rule(0.01)
    """Boundary: fires when entropy is below threshold on the first steps (nothing left to explore)."""
    boundary_entropy_high: RuleConfig = _rule(6.0, action="warn")
    """Boundary: fires when entropy exceeds threshold on the first steps (near-uniform: template mismatch)."""
    entropy_floor: RuleConfig = _rule(0.01, window=5)
    """Collapse: fires when entropy stays below threshold for window steps."""
    reward_zero_std: RuleConfig = _rule(0.9, window=5)
    """Collapse: fires when frac_reward_zero_std stays >= threshold for window steps (no advantage)."""
    lengths_frozen: RuleConfig = _rule(0.0, window=10, action="warn")
    """Collapse: fires when max_length - min_length <= threshold and mean_length is unchanged for window steps."""
    step_time: RuleConfig = _rule(0.005, window=3, action="warn")
    """Collapse: fires when step_time (seconds) stays below threshold for window steps."""
    max_prob: RuleConfig = _rule(0.99, window=5, action="warn")
    """Collapse: fires when logits/max_prob stays >= threshold for window steps."""
    zero_grad: RuleConfig = _rule(0.0, window=3)
    """Collapse: fires when |loss| and every grad norm stay <= threshold for window steps."""
    kind_trade: RuleConfig = _rule(0.3, window=10, action="warn")
    """Trade: fires when, over the last window steps (later half's mean vs earlier half's), one kind of item's reward fell by at least threshold while another kind's rose by at least threshold (grpo/health/kinds.py)."""
    abstention_rise: RuleConfig = _rule(0.25, window=10, action="warn")
    """Trade: fires when, over the last window steps (later half's mean vs earlier half's), the "unknown"/abstention rate on a kind whose context answers (disambiguated, answerable) rose by at least threshold."""
