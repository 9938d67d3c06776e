"""The sampler/trainer mismatch of an engine's rollout, measured with the trainer's own scoring."""

from __future__ import annotations

import torch

from grpo.config import RolloutConfig
from grpo.core.batching import join_prompt_completion
from grpo.core.importance import rollout_mismatch, truncated_is_weights
from grpo.core.logprobs import score_completions
from grpo.model.rollout import Rollout


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, rollout: Rollout, temperature: float) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens -> [N, C] on CPU; the scoring the loss uses (I3, I10),
    in the precision the caller's autocast sets (the step's: ``grpo.bf16``)."""
    device = next(model.parameters()).device
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    trainer = score_completions(model, joined.input_ids.to(device), joined.attention_mask.to(device),
                                rollout.completion_ids.shape[1], temperature).logprobs.float().cpu()
    return trainer


def sampler_mismatch(model: torch.nn.Module, rollout: Rollout, sampler_logprobs: torch.Tensor,
                     temperature: float) -> dict[str, float]:
    """``rollout_mismatch`` between the trainer's and the engine's log-probs (``sampler_logprobs`` [N, C])."""
    return rollout_mismatch(trainer_logprobs(model, rollout, temperature), sampler_logprobs,
                            rollout.completion_mask)


def sampler_correction(model: torch.nn.Module, rollout: Rollout, sampler_logprobs: torch.Tensor,
                       temperature: float, cfg: RolloutConfig) -> tuple[dict[str, float], torch.Tensor]:
    """The mismatch metrics and the truncated IS weights [N, C] of a rollout another engine sampled."""
    trainer = trainer_logprobs(model, rollout, temperature)
    mask = rollout.completion_mask
    weights = truncated_is_weights(trainer, sampler_logprobs, mask, cfg.tis_cap, cfg.tis_threshold)
    stats = rollout_mismatch(trainer, sampler_logprobs, mask)
    stats["sampling/importance_sampling_weight/mean"] = float(weights[mask].mean()) if mask.any() else 1.0
    return stats, weights
