"""Rollout engines: one interface over the trainer's own model (``rollout.py``) and vLLM (``grpo.rollout.engine``).

An engine turns prompt ids into a ``Rollout`` (token ids, completion masks by position, decoded texts,
I3–I6) and, when it samples with other kernels than the trainer, reports the log-probs it sampled
with, so the step can measure the mismatch and correct it (``grpo/core/importance.py``). The HF
engine is the trainer's own model: its sampled distribution is the trainer's (I10), it reports none.
The vLLM engine lives in ``vllm_engine.py`` and is imported only when chosen: vLLM is an optional
extra that needs CUDA. What both engines return and the interface they share are in ``engine_types.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import RolloutConfig, SamplingConfig
from grpo.model.engine_types import EngineRollout, RolloutEngine
from grpo.model.fast import FastPaths
from grpo.model.rollout import sample_rollout


class HFEngine:
    """The trainer's own model (``rollout.generate_rollout``, decoding as ``fast`` says): nothing to sync."""

    name = "hf"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        shared_prefill: bool = False,
        *,
        fast: FastPaths,
    ) -> None:
        self.model, self.tokenizer, self.shared_prefill, self.fast = model, tokenizer, shared_prefill, fast

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
        rollout, prefills = sample_rollout(
            self.model,
            self.tokenizer,
            prompts,
            group_size,
            sampling,
            eos_ids,
            seed,
            shared_prefill=self.shared_prefill,
            segments=segments,
            keep_prefill=keep_prefill,
            fast=self.fast,
            with_sampler=True,  # the step holds its scorer to what the decode computed (I3, I10)
        )
        return EngineRollout(rollout, None, prefills)

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            raise ValueError(
                "HFEngine samples from the trainer's model itself; build a new engine for another"
            )


def make_engine(
    cfg: RolloutConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int = 4096,
    seed: int = 0,
    shared_prefill: bool = False,
    *,
    fast: FastPaths,
) -> RolloutEngine:
    """The engine ``grpo.rollout.engine`` names, built around the trainer's ``model``; ``fast``: the run's fast
    paths (the hf engine decodes as they say)."""
    if cfg.engine == "hf":
        return HFEngine(model, tokenizer, shared_prefill=shared_prefill, fast=fast)
    from grpo.model.vllm_engine import VLLMEngine  # optional extra, CUDA only: imported when chosen

    return VLLMEngine(cfg, model, tokenizer, max_model_len=max_model_len, seed=seed)
