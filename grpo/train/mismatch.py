"""The sampler/trainer mismatch of an engine's rollout, measured with the trainer's own scoring."""

from __future__ import annotations

import torch

from grpo.core.batching import join_prompt_completion
from grpo.core.importance import rollout_mismatch
from grpo.core.logprobs import score_completions
from grpo.model.rollout import Rollout


@torch.no_grad()
def sampler_mismatch(model: torch.nn.Module, rollout: Rollout, sampler_logprobs: torch.Tensor,
                     temperature: float) -> dict[str, float]:
    """``rollout_mismatch`` between the trainer's log-probs of the sampled tokens and the engine's
    (``sampler_logprobs`` [N, C]); the same scoring the loss uses (I3, I10)."""
    device = next(model.parameters()).device
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    trainer = score_completions(model, joined.input_ids.to(device), joined.attention_mask.to(device),
                                rollout.completion_ids.shape[1], temperature).logprobs.float().cpu()
    return rollout_mismatch(trainer, sampler_logprobs, rollout.completion_mask)
