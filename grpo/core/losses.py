"""The clipped GRPO surrogate, the k3 KL and the entropy bonus (I7, I8).

``total_loss`` is the one place where ``policy + beta * kl - entropy_coef * entropy`` is written
(I7): every gradient mode of ``grpo.multitask`` goes through it, so the entropy sign cannot
differ between paths. Ratios and KL are per token (I8). Masked-out positions never enter an
``exp`` and are selected away with ``torch.where``, so whatever sits there (±1e4, inf) changes
nothing (I11).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from grpo.core.importance import weight_token_losses
from grpo.errors import GrpoError

LossType = Literal["grpo", "dr_grpo", "token_mean"]
LOSS_TYPES = ("grpo", "dr_grpo", "token_mean")


class LossError(GrpoError, ValueError):
    """Loss inputs or settings do not fit together; the message names the value and the fix."""


class LossTerms(NamedTuple):
    policy: torch.Tensor  # [] clipped surrogate, aggregated by loss_type
    kl: torch.Tensor  # [] k3 KL to the reference, aggregated by loss_type (0 without a reference)
    entropy: torch.Tensor  # [] entropy of the scoring distribution, aggregated by loss_type


class SurrogateTokens(NamedTuple):
    loss: torch.Tensor  # [N, C] -min(ratio * A, clip(ratio) * A)
    ratio: torch.Tensor  # [N, C] exp(logprobs - old_logprobs), 1 on masked-out positions
    low_clipped: torch.Tensor  # [N, C] bool: ratio < 1 - epsilon_low and A < 0 (clip is active)
    high_clipped: torch.Tensor  # [N, C] bool: ratio > 1 + epsilon_high and A > 0 (clip is active)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, 0 elsewhere; unlike ``values * mask``, inf/NaN cannot leak."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is True (0 when none) -> []."""
    return _masked(values, mask).sum() / mask.sum().clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,  # [N, C] per-token values
    mask: torch.Tensor,  # [N, C] True/1 = token takes part (completion_mask)
    loss_type: LossType,
    max_completion_length: int,
) -> torch.Tensor:
    """Aggregate per-token values into a scalar; the choice sets how length weighs.

    - ``grpo``: mean over each sequence's tokens, then over sequences (DeepSeekMath). Every
      sequence weighs the same, so a token of a long sequence weighs less: for a positive
      advantage short correct answers are pushed hardest, for a negative one long wrong answers
      are punished least, so wrong answers drift longer.
    - ``dr_grpo``: sum over all tokens / (N * max_completion_length) (Dr. GRPO, arXiv 2503.20783).
      A constant normaliser: every token weighs the same whatever its sequence's length, so no
      length bias; the loss scale shrinks when completions are shorter than the maximum.
    - ``token_mean``: sum over all tokens / number of tokens (DAPO, arXiv 2503.14476). Every token
      weighs the same within a batch; the normaliser still varies between batches.
    """
    values = _masked(loss_mat, mask)
    if loss_type == "grpo":
        per_sequence = values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [N]
        return per_sequence.mean()
    if loss_type == "dr_grpo":
        if max_completion_length < 1:
            raise LossError(
                f"agg_loss: dr_grpo needs max_completion_length >= 1 (got {max_completion_length}); "
                "pass grpo.sampling.max_new_tokens"
            )
        return values.sum() / (loss_mat.shape[0] * max_completion_length)
    if loss_type == "token_mean":
        return values.sum() / mask.sum().clamp(min=1)
    raise LossError(f"grpo.loss.loss_type must be one of {LOSS_TYPES} (got {loss_type!r})")


def clipped_surrogate(
    logprobs: torch.Tensor,  # [N, C] fp32, current policy, with grad
    old_logprobs: torch.Tensor,  # [N, C] fp32, policy that sampled (no grad)
    advantages: torch.Tensor,  # [N]
    completion_mask: torch.Tensor,  # [N, C]
    epsilon_low: float,
    epsilon_high: float,
) -> SurrogateTokens:
    """Per-token PPO clip (I8: the ratio of each token, never of a sequence mean).

    ========  =====  ======================  =====================
    A         ratio  loss (eps 0.2 / 0.28)   clip active
    ========  =====  ======================  =====================
    +1        1.0    -1.0                    no
    +1        1.5    -1.28                   high
    +1        0.5    -0.5                    no (min keeps ratio)
    -1        0.5    0.8                     low
    -1        1.5    1.5                     no (min keeps ratio)
    0         2.0    0.0                     no
    ========  =====  ======================  =====================
    """
    log_ratio = _masked(logprobs - old_logprobs, completion_mask)  # [N, C], 0 where masked out
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages.reshape(-1, 1).to(ratio.dtype)  # [N, 1]
    loss = -torch.min(ratio * adv, clipped * adv)
    low_clipped = (ratio < 1.0 - epsilon_low) & (adv < 0)
    high_clipped = (ratio > 1.0 + epsilon_high) & (adv > 0)
    return SurrogateTokens(loss, ratio, low_clipped, high_clipped)


def k3_kl(
    logprobs: torch.Tensor,  # [N, C]
    ref_logprobs: torch.Tensor,  # [N, C]
    completion_mask: torch.Tensor,  # [N, C]
) -> torch.Tensor:
    """Per-token k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` >= 0 (arXiv 2402.03300 eq. 4) -> [N, C]."""
    delta = _masked(ref_logprobs - logprobs, completion_mask)
    return torch.exp(delta) - delta - 1.0


def policy_loss_terms(
    logprobs: torch.Tensor,  # [N, C] fp32, with grad
    old_logprobs: torch.Tensor,  # [N, C]
    ref_logprobs: torch.Tensor | None,  # [N, C] or None (no KL term)
    advantages: torch.Tensor,  # [N]
    completion_mask: torch.Tensor,  # [N, C] True/1 = completion token that takes part
    entropy: torch.Tensor,  # [N, C]
    *,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: LossType,
    max_completion_length: int,
    token_weights: torch.Tensor | None = None,  # [N, C] truncated IS weights (core/importance.py)
) -> tuple[LossTerms, dict[str, float]]:
    """The three loss terms, each aggregated with ``agg_loss``, and their statistics. ``token_weights``
    reweight the policy term per token (rollouts sampled by another engine); KL and entropy are not.

    Stats (token means over the mask, TRL names): ``kl``, ``entropy``, ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``ratio/mean``.
    """
    tokens = clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, epsilon_low, epsilon_high)
    per_token = tokens.loss if token_weights is None else weight_token_losses(tokens.loss, token_weights)
    policy = agg_loss(per_token, completion_mask, loss_type, max_completion_length)
    if ref_logprobs is None:
        per_token_kl = torch.zeros_like(logprobs)
    else:
        per_token_kl = k3_kl(logprobs, ref_logprobs, completion_mask)
    kl = agg_loss(per_token_kl, completion_mask, loss_type, max_completion_length)
    entropy_term = agg_loss(entropy, completion_mask, loss_type, max_completion_length)
    with torch.no_grad():
        stats = {
            "kl": masked_mean(per_token_kl, completion_mask),
            "entropy": masked_mean(entropy, completion_mask),
            "clip_ratio/low_mean": masked_mean(tokens.low_clipped.float(), completion_mask),
            "clip_ratio/high_mean": masked_mean(tokens.high_clipped.float(), completion_mask),
            "clip_ratio/region_mean": masked_mean(
                (tokens.low_clipped | tokens.high_clipped).float(), completion_mask
            ),
            "ratio/mean": masked_mean(tokens.ratio, completion_mask),
        }
    return LossTerms(policy, kl, entropy_term), {name: float(value) for name, value in stats.items()}


def total_loss(terms: LossTerms, beta: float, entropy_coef: float) -> torch.Tensor:
    """``policy + beta * kl - entropy_coef * entropy`` (I7): written here and nowhere else.

    A positive ``entropy_coef`` is a bonus: minimising the loss raises entropy.
    """
    return terms.policy + beta * terms.kl - entropy_coef * terms.entropy
