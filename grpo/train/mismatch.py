"""The sampler/trainer mismatch of an engine's rollout, measured with the trainer's own scoring."""

from __future__ import annotations

import torch

from grpo.config import RolloutConfig
from grpo.core.importance import rollout_mismatch, truncated_is_weights
from grpo.model.rollout import Rollout
from grpo.model.scoring import rollout_inputs, score_inputs


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens -> [N, C] on CPU: ``model.scoring``'s path, under
    the rollout's temperature (I3, I10), in the precision of the caller's autocast (the step's)."""
    inputs = rollout_inputs(rollout, next(model.parameters()).device)
    return score_inputs(model, inputs).logprobs.float().cpu()


def sampler_correction(
    model: torch.nn.Module, rollout: Rollout, sampler_logprobs: torch.Tensor, cfg: RolloutConfig
) -> tuple[dict[str, float], torch.Tensor]:
    """The mismatch metrics and the truncated IS weights [N, C] of a rollout another engine sampled."""
    trainer = trainer_logprobs(model, rollout)
    mask = rollout.completion_mask
    weights = truncated_is_weights(trainer, sampler_logprobs, mask, cfg.tis_cap, cfg.tis_threshold)
    stats = rollout_mismatch(trainer, sampler_logprobs, mask)
    stats["sampling/importance_sampling_weight/mean"] = float(weights[mask].mean()) if mask.any() else 1.0
    return stats, weights
