"""Sampler/trainer mismatch and truncated importance sampling (TIS) for rollouts from another engine.

A fast inference engine (vLLM) samples with its own kernels, so the probability it gave a sampled
token, ``p_sampler``, differs from the trainer's ``p_trainer`` for the same weights (bf16 kernels,
batch-dependent reductions). The loss assumes the tokens came from ``p_trainer``; the per-token weight
``min(p_trainer / p_sampler, C)`` corrects the expectation, and truncating at ``C`` bounds its
variance (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
the ``vllm_importance_sampling_cap`` of TRL and the token-level ``rollout_is`` of verl). Metric names
follow TRL's ``sampling/*``.
"""

from __future__ import annotations

import torch


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()]


def rollout_mismatch(
    trainer_logprobs: torch.Tensor,  # [N, C] log p_trainer of the sampled tokens
    sampler_logprobs: torch.Tensor,  # [N, C] log p_sampler the engine reported for the same tokens
    completion_mask: torch.Tensor,  # [N, C] True = the token takes part
) -> dict[str, float]:
    """Per-token mismatch over the completion tokens: |Δ log p| mean and max, the k3 estimate of
    KL(sampler || trainer) (the tokens were drawn from the sampler), and the ratio's range."""
    delta = _masked(trainer_logprobs.float() - sampler_logprobs.float(), completion_mask)  # [T]
    if delta.numel() == 0:
        return {
            "sampling/sampling_logp_difference/mean": 0.0,
            "sampling/sampling_logp_difference/max": 0.0,
            "sampling/kl": 0.0,
            "sampling/importance_sampling_ratio/min": 1.0,
            "sampling/importance_sampling_ratio/max": 1.0,
        }
    ratio = delta.exp()
    return {
        "sampling/sampling_logp_difference/mean": float(delta.abs().mean()),
        "sampling/sampling_logp_difference/max": float(delta.abs().max()),
        "sampling/kl": float((ratio - 1 - delta).mean()),
        "sampling/importance_sampling_ratio/min": float(ratio.min()),
        "sampling/importance_sampling_ratio/max": float(ratio.max()),
    }


def truncated_is_weights(
    trainer_logprobs: torch.Tensor,  # [N, C]
    sampler_logprobs: torch.Tensor,  # [N, C]
    completion_mask: torch.Tensor,  # [N, C]
    cap: float,
    threshold: float = 0.0,
) -> torch.Tensor:
    """Per-token weights ``min(exp(log p_trainer - log p_sampler), cap)`` -> [N, C], detached, 0 off
    the mask; all ones when the mean |Δ log p| is at most ``threshold`` (small mismatch: no correction)."""
    if cap < 1.0:
        raise ValueError(
            f"truncated_is_weights: cap must be >= 1 (got {cap}); it bounds the weight from above"
        )
    mask = completion_mask.bool()
    delta = (trainer_logprobs.detach().float() - sampler_logprobs.float()).masked_fill(~mask, 0.0)
    if mask.any() and float(delta[mask].abs().mean()) <= threshold:
        return mask.float()
    return delta.exp().clamp(max=cap) * mask


def weight_token_losses(
    per_token_loss: torch.Tensor,  # [N, C] the policy term per token
    weights: torch.Tensor,  # [N, C] from truncated_is_weights
) -> torch.Tensor:
    """The policy term reweighted token by token (the weights carry no gradient) -> [N, C]."""
    return per_token_loss * weights.detach().to(per_token_loss.dtype)
