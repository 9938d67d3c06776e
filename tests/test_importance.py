"""grpo/core/importance.py: the sampler/trainer mismatch metric and truncated importance sampling."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.core.importance import rollout_mismatch, truncated_is_weights, weight_token_losses

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -7.0]])  # [N=2, C=3]
SAMPLER = torch.tensor([[-1.0, -2.5, -0.5], [-0.3, -1.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])  # the last token is padding


def test_mismatch_reads_completion_tokens_only():
    stats = rollout_mismatch(TRAINER, SAMPLER, MASK)
    deltas = torch.tensor([0.0, 0.5, 0.0, 0.2, -2.0])  # trainer - sampler on the masked tokens
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(float(deltas.abs().mean()))
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)  # not the padded 7.0
    assert stats["sampling/kl"] == pytest.approx(float((deltas.exp() - 1 - deltas).mean()))
    assert stats["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-2.0))
    assert stats["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))


def test_identical_log_probs_give_zero_mismatch_and_unit_weights():
    stats = rollout_mismatch(TRAINER, TRAINER, MASK)
    assert stats["sampling/sampling_logp_difference/max"] == 0.0 and stats["sampling/kl"] == 0.0
    torch.testing.assert_close(truncated_is_weights(TRAINER, TRAINER, MASK, cap=2.0), MASK.float())


def test_weights_are_truncated_at_the_cap_and_zero_off_the_mask():
    weights = truncated_is_weights(TRAINER, SAMPLER, MASK, cap=1.5)  # [N, C]
    assert weights.shape == (2, 3)
    want = torch.tensor([[1.0, 1.5, 1.0], [1.5, math.exp(-2.0), 0.0]])  # e^0.5 = 1.65 and e^0.2... capped
    want[1, 0] = math.exp(0.2)
    torch.testing.assert_close(weights, want)


def test_small_mismatch_under_the_threshold_applies_no_correction():
    near = SAMPLER.clone()
    near[MASK] = TRAINER[MASK] + 0.01
    torch.testing.assert_close(truncated_is_weights(TRAINER, near, MASK, cap=2.0, threshold=0.05), MASK.float())
    assert not torch.equal(truncated_is_weights(TRAINER, near, MASK, cap=2.0, threshold=0.0), MASK.float())


def test_a_mismatch_at_the_threshold_itself_applies_no_correction():
    """``tis_threshold`` is the largest mean |Δ log p| left uncorrected: at it exactly, the weights are the
    mask; a little above it, they are the ratios."""
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler = torch.tensor([[-1.25, -2.25, -3.0]])  # |Δ| 0.25 on the two masked tokens: exact in binary
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(truncated_is_weights(trainer, sampler, mask, cap=2.0, threshold=0.25), mask.float())
    weights = truncated_is_weights(trainer, sampler, mask, cap=2.0, threshold=0.24)
    torch.testing.assert_close(weights, torch.tensor([[torch.e ** 0.25, torch.e ** 0.25, 0.0]]))


def test_weights_carry_no_gradient_into_the_loss():
    trainer = TRAINER.clone().requires_grad_(True)
    weights = truncated_is_weights(trainer, SAMPLER, MASK, cap=2.0)
    loss = weight_token_losses(-trainer, weights).sum()
    loss.backward()
    torch.testing.assert_close(trainer.grad, -weights)  # d/dlogp of -w*logp is -w: w is a constant


def test_cap_below_one_is_an_error():
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(TRAINER, SAMPLER, MASK, cap=0.5)


def test_a_cap_of_one_is_allowed_and_only_lowers_weights():
    """``cap`` 1 is the bound itself (weights never above 1), not an error."""
    trainer = torch.log(torch.tensor([[2.0, 0.5]]))
    weights = truncated_is_weights(trainer, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), cap=1.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5]]))


def test_a_rollout_without_completion_tokens_reads_no_mismatch():
    """Every token masked out (completions that stopped at once, all of them): the neutral statistics, the
    ratio's range a single 1, not an error and not NaN."""
    stats = rollout_mismatch(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert stats == {
        "sampling/sampling_logp_difference/mean": 0.0,
        "sampling/sampling_logp_difference/max": 0.0,
        "sampling/kl": 0.0,
        "sampling/importance_sampling_ratio/min": 1.0,
        "sampling/importance_sampling_ratio/max": 1.0,
    }
