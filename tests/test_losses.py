"""Tests of grpo/core/losses.py: I7 (one loss formula, entropy sign), I8 (per-token ratio, step 0), I11."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.core.batching import left_pad
from grpo.core.logprobs import score_completions
from grpo.core.losses import (
    LossError,
    LossTerms,
    agg_loss,
    clipped_surrogate,
    k3_kl,
    masked_mean,
    policy_loss_terms,
    total_loss,
)

CLIP = {"epsilon_low": 0.2, "epsilon_high": 0.28}
STAT_NAMES = {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio/mean"}


def random_inputs(seed: int = 0, n: int = 4, width: int = 6):
    """(logprobs [N, C] with grad, old, ref, advantages [N], completion_mask [N, C], entropy [N, C])."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(n, width, generator=gen)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(n, width, generator=gen)
    ref = logprobs.detach() + 0.3 * torch.randn(n, width, generator=gen)
    advantages = torch.randn(n, generator=gen)
    lengths = torch.tensor([width, 1, width // 2, width - 1])[:n]
    completion_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    entropy = 3 * torch.rand(n, width, generator=gen)
    return logprobs, old, ref, advantages, completion_mask, entropy


# --------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize(("loss_type", "expected"), [("grpo", 2.75), ("token_mean", 7 / 3), ("dr_grpo", 7 / 8)])
def test_agg_loss_modes_on_a_hand_computed_example(loss_type, expected):
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # grpo: mean((1+2)/2, 4/1) = 2.75; token_mean: (1+2+4)/3; dr_grpo: (1+2+4)/(2 * 4).
    assert agg_loss(loss_mat, mask, loss_type, max_completion_length=4).item() == pytest.approx(expected)


def test_agg_loss_rejects_unknown_type_and_dr_grpo_without_length():
    with pytest.raises(LossError, match="loss_type"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "seq_mean", 2)
    with pytest.raises(LossError, match="max_completion_length"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "dr_grpo", 0)
    assert agg_loss(torch.full((1, 2), 3.0), torch.tensor([[1, 0]]), "dr_grpo", 1).item() == 3.0, "1 is a length"


@pytest.mark.parametrize("loss_type", ["grpo", "token_mean", "dr_grpo"])
def test_a_row_or_a_batch_without_completion_tokens_weighs_zero_never_nan(loss_type):
    """A completion of no token (a row whose mask is all False; a task's rows all empty) adds 0 to the loss
    and its statistics: the divisors are clamped to at least one token, never 0 / 0."""
    loss_mat = torch.tensor([[2.0, 4.0], [7.0, 9.0]])
    mask = torch.tensor([[True, True], [False, False]])
    expected = {"grpo": 3.0 / 2, "token_mean": 3.0, "dr_grpo": 6.0 / 4}[loss_type]
    assert agg_loss(loss_mat, mask, loss_type, 2).item() == pytest.approx(expected)
    assert agg_loss(loss_mat, torch.zeros_like(mask), loss_type, 2).item() == 0.0
    assert masked_mean(loss_mat, torch.zeros_like(mask)).item() == 0.0
    assert masked_mean(loss_mat, mask).item() == 3.0


# --------------------------------------------------------------------------- clipping


@pytest.mark.parametrize(
    ("advantage", "ratio", "loss", "low", "high"),
    [  # the table of clipped_surrogate's docstring, epsilon_low 0.2, epsilon_high 0.28
        (1.0, 1.0, -1.0, False, False),
        (1.0, 1.5, -1.28, False, True),
        (1.0, 0.5, -0.5, False, False),
        (-1.0, 0.5, 0.8, True, False),
        (-1.0, 1.5, 1.5, False, False),
        (0.0, 2.0, 0.0, False, False),
        (0.0, 0.5, 0.0, False, False),  # no advantage: no clip is active, low or high
    ],
)
def test_clipping_table(advantage, ratio, loss, low, high):
    logprobs = torch.tensor([[math.log(ratio)]])
    tokens = clipped_surrogate(logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), **CLIP)
    assert tokens.loss.item() == pytest.approx(loss, abs=1e-6)
    assert tokens.ratio.item() == pytest.approx(ratio, abs=1e-6)
    assert (tokens.low_clipped.item(), tokens.high_clipped.item()) == (low, high)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_ratio_on_the_clip_edge_is_not_clipped(advantage):
    """With both epsilons 0 the clip range is the single point 1: a ratio of exactly 1 sits on its edge,
    where clipping changes nothing, so neither clip counts it."""
    tokens = clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1),
                               epsilon_low=0.0, epsilon_high=0.0)
    assert tokens.ratio.item() == 1.0 and tokens.loss.item() == -advantage
    assert not tokens.low_clipped.item() and not tokens.high_clipped.item()


def test_clip_statistics_count_active_clips_over_the_mask():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0, 9.0]]))
    mask = torch.tensor([[1, 1, 1, 0]])  # the last token is out: its ratio 9 must not count
    _, stats = policy_loss_terms(
        logprobs, torch.zeros(1, 4), None, torch.tensor([1.0]), mask, torch.zeros(1, 4),
        **CLIP, loss_type="token_mean", max_completion_length=4,
    )
    assert set(stats) == STAT_NAMES
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert stats["clip_ratio/low_mean"] == 0.0  # ratio 0.5 with A > 0: the min keeps the ratio
    assert stats["clip_ratio/region_mean"] == pytest.approx(1 / 3)
    assert stats["ratio/mean"] == pytest.approx((1.5 + 0.5 + 1.0) / 3, abs=1e-6)


# --------------------------------------------------------------------------- I8


def test_i8_ratio_is_one_and_kl_zero_at_step_zero(tiny_model, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(t) for t in ("Answer: A.", "The river town of Elbrook was founded.")]
    prompt = left_pad(prompts, tiny_tokenizer.pad_token_id)
    completions = torch.randint(10, len(tiny_tokenizer), (2, 4), generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([prompt.input_ids, completions], dim=1)
    attention_mask = torch.cat([prompt.attention_mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
    completion_mask = torch.ones(2, 4, dtype=torch.bool)
    scored = score_completions(tiny_model, input_ids, attention_mask, 4, temperature=0.9)
    with torch.no_grad():  # the reference is the same (SFT) model at step 0
        ref = score_completions(tiny_model, input_ids, attention_mask, 4, temperature=0.9)
    old = scored.logprobs.detach()
    tokens = clipped_surrogate(scored.logprobs, old, torch.tensor([1.0, -1.0]), completion_mask, **CLIP)
    assert torch.equal(tokens.ratio, torch.ones(2, 4))
    assert torch.equal(k3_kl(scored.logprobs, ref.logprobs, completion_mask), torch.zeros(2, 4))
    terms, stats = policy_loss_terms(
        scored.logprobs, old, ref.logprobs, torch.tensor([1.0, -1.0]), completion_mask, scored.entropy,
        **CLIP, loss_type="grpo", max_completion_length=4,
    )
    assert stats["ratio/mean"] == 1.0 and stats["kl"] == 0.0 and terms.kl.item() == 0.0
    assert stats["clip_ratio/region_mean"] == 0.0


def test_i8_ratio_is_per_token():
    logprobs, old, _, advantages, completion_mask, entropy = random_inputs()
    moved = logprobs.detach().clone()
    moved[0, 1] += 0.1
    before = clipped_surrogate(logprobs.detach(), old, advantages, completion_mask, **CLIP).ratio
    after = clipped_surrogate(moved, old, advantages, completion_mask, **CLIP).ratio
    changed = (after != before).nonzero().tolist()
    assert changed == [[0, 1]]
    assert after[0, 1].item() == pytest.approx(before[0, 1].item() * math.exp(0.1), rel=1e-5)


def test_i8_kl_is_the_per_token_k3_estimator():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    delta = ref - logprobs
    expected = torch.exp(delta) - delta - 1  # arXiv 2402.03300 eq. 4
    torch.testing.assert_close(k3_kl(logprobs, ref, torch.ones(1, 3)), expected, atol=1e-6, rtol=0)
    assert (k3_kl(logprobs, ref, torch.ones(1, 3)) >= 0).all()


def loss_of(logprobs, old, ref, advantages, completion_mask, entropy, *, beta, entropy_coef, **common):
    """What production computes: the step's ``policy_loss_terms``, then multitask's ``total_loss``."""
    terms, stats = policy_loss_terms(logprobs, old, ref, advantages, completion_mask, entropy, **common)
    return total_loss(terms, beta, entropy_coef), stats


# --------------------------------------------------------------------------- I11


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "token_mean"])
def test_i11_loss_unchanged_when_padded_positions_hold_plus_minus_1e4(loss_type):
    logprobs, old, ref, advantages, completion_mask, entropy = random_inputs(seed=1)
    kwargs = {**CLIP, "loss_type": loss_type, "max_completion_length": 6, "beta": 0.04, "entropy_coef": 0.01}
    clean, _ = loss_of(logprobs, old, ref, advantages, completion_mask, entropy, **kwargs)
    (clean_grad,) = torch.autograd.grad(clean, logprobs)
    out = ~completion_mask
    signs = torch.where(torch.rand(out.shape, generator=torch.Generator().manual_seed(2)) > 0.5, 1e4, -1e4)

    def dirty(t: torch.Tensor, sign: float) -> torch.Tensor:
        return torch.where(out, sign * signs, t)

    dirty_logprobs = dirty(logprobs.detach(), 1.0).requires_grad_()
    loss, _ = loss_of(
        dirty_logprobs, dirty(old, -1.0), dirty(ref, 1.0), advantages, completion_mask, dirty(entropy, -1.0), **kwargs
    )
    (grad,) = torch.autograd.grad(loss, dirty_logprobs)
    assert torch.isfinite(loss) and torch.equal(loss, clean)
    assert torch.equal(grad, clean_grad)


# --------------------------------------------------------------------------- I7


@pytest.mark.parametrize("entropy_coef", [0.5, -0.2, 0.0])
def test_i7_gradient_of_total_loss_wrt_entropy_is_minus_entropy_coef(entropy_coef):
    terms = LossTerms(torch.tensor(0.3), torch.tensor(0.1), torch.tensor(2.0, requires_grad=True))
    (grad,) = torch.autograd.grad(total_loss(terms, beta=0.04, entropy_coef=entropy_coef), terms.entropy)
    assert grad.item() == pytest.approx(-entropy_coef)
    assert total_loss(terms, 0.04, entropy_coef).item() == pytest.approx(0.3 + 0.04 * 0.1 - entropy_coef * 2.0)


def test_i7_entropy_bonus_gradient_is_negative_on_kept_tokens_only():
    """A bonus: minimising the loss raises entropy, so d loss / d entropy < 0 on every kept token."""
    logprobs, old, ref, advantages, completion_mask, entropy = random_inputs(seed=3)
    common = {**CLIP, "loss_type": "grpo", "max_completion_length": 6}
    entropy_leaf = entropy.clone().requires_grad_()
    with_leaf, _ = loss_of(
        logprobs, old, ref, advantages, completion_mask, entropy_leaf, **common, beta=0.1, entropy_coef=0.05
    )
    (entropy_grad,) = torch.autograd.grad(with_leaf, entropy_leaf)
    assert (entropy_grad[completion_mask] < 0).all() and (entropy_grad[~completion_mask] == 0).all()


def test_no_reference_means_no_kl_term():
    logprobs, old, _, advantages, completion_mask, entropy = random_inputs()
    common = {**CLIP, "loss_type": "grpo", "max_completion_length": 6, "entropy_coef": 0.0}
    loss, stats = loss_of(logprobs, old, None, advantages, completion_mask, entropy, **common, beta=0.0)
    assert stats["kl"] == 0.0 and torch.isfinite(loss)
