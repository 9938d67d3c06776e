"""What a rollout engine returns (``EngineRollout``) and what the step asks of one (``RolloutEngine``).

Apart from the engines themselves (``engines.py``: the trainer's own model and the factory;
``vllm_engine.py``: vLLM), so each engine builds on them without importing the other.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.config import SamplingConfig
from grpo.core.prefix import PromptPrefill
from grpo.model.rollout import Rollout


@dataclass(frozen=True)
class EngineRollout:
    """One rollout as an engine returns it, with what only some engines report."""

    rollout: Rollout
    sampler_logprobs: torch.Tensor | None  # [N, C] log-probs the engine sampled with; None: the trainer's
    prefills: tuple[PromptPrefill, ...] = ()  # the trainer's prefill with its graph, when asked and kept


class RolloutEngine(Protocol):
    """What the step asks of a generation engine."""

    name: str

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        eos_ids: Sequence[int],
        seed: int,
        segments: Sequence[Hashable] | None = None,
        keep_prefill: bool = False,
    ) -> EngineRollout:
        """``group_size`` completions per prompt (ids from ``chat.render_prompt``), seeded by ``seed``.
        ``segments`` (a label per prompt): the trainer's shared prefill runs one pass per label, and
        ``keep_prefill`` keeps those passes with their graph for the update to reuse
        (``rollout.sample_rollout``); an engine that does not prefill on the trainer's model keeps none."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (after every optimizer step)."""
