"""Tests of grpo/core/logprobs.py: I10 (temperature-scaled distribution) and I11 (padding changes nothing)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.core.batching import left_pad, position_ids_from_mask
from grpo.core.logprobs import (
    Scored,
    ScoringError,
    entropy_from_logits,
    logits_stats,
    score_completions,
    selective_log_softmax,
)

PROMPTS = (
    "Context: Two friends met at the station. Question: Who was late?",
    "Answer: A.",
    "The river town of Elbrook was founded by Mara Venn.",
)
WIDTH = 5  # completion width C
ENDS = (5, 2, 4)  # completion tokens that take part per row (the rest is padding after the end)


def completion_batch(tokenizer, seed: int = 0):
    """Left-padded prompts + completions of width C; rows end early, positions after the end are pad.

    Returns (input_ids [B, P+C], attention_mask [B, P+C], completion_mask [B, C] bool, rows) where
    rows[i] is row i alone, without padding on the left.
    """
    gen = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    completion_mask = torch.arange(WIDTH).unsqueeze(0) < torch.tensor(ENDS).unsqueeze(1)  # [B, C]
    completions = torch.randint(10, len(tokenizer), (len(PROMPTS), WIDTH), generator=gen)
    completions = torch.where(completion_mask, completions, tokenizer.pad_token_id)
    prompt = left_pad(prompts, tokenizer.pad_token_id)
    input_ids = torch.cat([prompt.input_ids, completions], dim=1)
    attention_mask = torch.cat([prompt.attention_mask, completion_mask.long()], dim=1)
    rows = [
        (torch.tensor([ids + completions[i].tolist()]), torch.cat([torch.ones(len(ids)), completion_mask[i]]).long()[None])
        for i, ids in enumerate(prompts)
    ]
    return input_ids, attention_mask, completion_mask, rows


# --------------------------------------------------------------------------- selective_log_softmax


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)]
)
def test_selective_log_softmax_matches_gather_log_softmax(dtype, atol):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=gen)).to(dtype)  # [B, T, V]
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    out = selective_log_softmax(logits, ids)
    same_dtype = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    upcast = logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert out.shape == (3, 7) and out.dtype == torch.float32
    torch.testing.assert_close(out, same_dtype, atol=atol, rtol=0)
    # Low precision is upcast per row, so the result is as exact as fp32 from the same inputs.
    torch.testing.assert_close(out, upcast, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- entropy and stats


def test_entropy_chunked_equals_unchunked_and_manual():
    logits = 4 * torch.randn(2, 9, 30, generator=torch.Generator().manual_seed(1))
    manual = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # [B, T]
    chunked = entropy_from_logits(logits, chunk_size=4)
    whole = entropy_from_logits(logits, chunk_size=10_000)
    assert chunked.shape == (2, 9)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked, manual, atol=1e-5, rtol=0)
    # Every chunk's gradient reaches its own rows (18 positions in chunks of 4: the last one short).
    weights = torch.linspace(-1, 1, 18).reshape(2, 9)
    grads = []
    for size in (4, 10_000):
        leaf = logits.clone().requires_grad_()
        (entropy_from_logits(leaf, chunk_size=size) * weights).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)
    assert (grads[0].abs().sum(-1) > 0).all()


def test_entropy_of_uniform_is_log_v_and_huge_logits_stay_finite():
    vocab = 37
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, vocab)), torch.full((2, 3), math.log(vocab)))
    peaked = torch.zeros(1, 4, vocab)
    peaked[..., 0] = 1e4  # one token takes all the mass: entropy 0, never NaN
    assert torch.equal(entropy_from_logits(peaked.half()), torch.zeros(1, 4))


def test_entropy_keeps_fp32_precision_at_large_logit_offsets():
    """Shifting every logit by 60 changes nothing mathematically; the lse - sum(p*z) form lost 1e-5 here."""
    base = 3 * torch.randn(4, 16, 500, generator=torch.Generator().manual_seed(3))
    for offset in (0.0, 60.0, -60.0, 600.0):
        logits = base + offset  # fp32, as the model hands them over
        exact = -(logits.double().softmax(-1) * logits.double().log_softmax(-1)).sum(-1)  # fp64 reference
        error = float((entropy_from_logits(logits).double() - exact).abs().max())
        assert error < 2e-6, f"offset {offset}: max error {error:.2e} against fp64"


def test_entropy_rejects_chunk_size_zero_and_takes_one_position_a_chunk():
    with pytest.raises(ScoringError, match="chunk_size"):
        entropy_from_logits(torch.zeros(1, 2, 3), chunk_size=0)
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=1), entropy_from_logits(logits), rtol=0, atol=0)
    assert entropy_from_logits(torch.zeros(0, 5)).shape == (0,)


def test_logits_stats_hand_example_uses_only_masked_positions():
    logits = torch.tensor(
        [[[5.0, 3.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 6], [[100.0, -100.0, 0, 0, 0, 0], [1.0, 1.0, 1, 1, 1, 1]]]
    )  # [B=2, T=2, V=6]
    mask = torch.tensor([[1, 1], [0, 1]])  # row 1 position 0 is left out
    stats = logits_stats(logits, mask)
    expected_mass_first = float(torch.softmax(logits[0, 0], -1).topk(5).values.sum())
    assert stats["logits/max"] == pytest.approx((5.0 + 0.0 + 1.0) / 3)
    assert stats["logits/top1_gap"] == pytest.approx((2.0 + 0.0 + 0.0) / 3)
    assert stats["logits/top5_mass"] == pytest.approx((expected_mass_first + 5 / 6 + 5 / 6) / 3, abs=1e-6)
    expected_max_prob_first = float(torch.softmax(logits[0, 0], -1).max())
    assert stats["logits/max_prob"] == pytest.approx((expected_max_prob_first + 1 / 6 + 1 / 6) / 3, abs=1e-6)
    assert logits_stats(logits, torch.zeros(2, 2)) == {
        "logits/max": 0.0, "logits/top1_gap": 0.0, "logits/top5_mass": 0.0, "logits/max_prob": 0.0
    }
    one = logits_stats(logits, torch.tensor([[1, 0], [0, 0]]))  # a single position: its own gap
    assert (one["logits/max"], one["logits/top1_gap"]) == (5.0, 2.0)


# --------------------------------------------------------------------------- score_completions


def test_score_completions_shapes_and_gradient(tiny_model, tiny_tokenizer):
    input_ids, attention_mask, _, _ = completion_batch(tiny_tokenizer)
    scored = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature=1.0)
    assert isinstance(scored, Scored)
    assert scored.logprobs.shape == scored.entropy.shape == (3, WIDTH)
    assert scored.logprobs.dtype == scored.entropy.dtype == torch.float32
    assert set(scored.logits_stats) == {"logits/max", "logits/top1_gap", "logits/top5_mass", "logits/max_prob"}
    (scored.logprobs.sum() + scored.entropy.sum()).backward()
    assert tiny_model.lm_head.weight.grad is not None and tiny_model.lm_head.weight.grad.abs().sum() > 0


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_score_completions_logprobs_only_are_the_full_scorings_bit_for_bit(tiny_model, tiny_tokenizer, temperature):
    """The reference and old log-probs are scored without entropy or statistics; they must be the very
    numbers a full scoring (the update's pass) gives, or the ratio and KL of step 0 are not 1 and 0."""
    input_ids, attention_mask, _, _ = completion_batch(tiny_tokenizer)
    full = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature)
    alone = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature, logprobs_only=True)
    assert torch.equal(alone.logprobs, full.logprobs)
    assert alone.entropy is None and alone.logits_stats == {}


def test_score_completions_rejects_bad_width_and_temperature(tiny_model, tiny_tokenizer):
    input_ids, attention_mask, _, _ = completion_batch(tiny_tokenizer)
    with pytest.raises(ScoringError, match="completion_width"):
        score_completions(tiny_model, input_ids, attention_mask, input_ids.shape[1], temperature=1.0)
    with pytest.raises(ScoringError, match="completion_width"):
        score_completions(tiny_model, input_ids, attention_mask, 0, temperature=1.0)
    with pytest.raises(ScoringError, match="temperature"):
        score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature=0.0)


@torch.no_grad()
@pytest.mark.parametrize("full_logits", [False, True], ids=["in-head", "full-logits"])
def test_i10_logprobs_and_entropy_use_temperature_scaled_distribution(tiny_model, tiny_tokenizer, full_logits):
    input_ids, attention_mask, _, _ = completion_batch(tiny_tokenizer)
    full = tiny_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits  # [B, P+C, V]
    predicting = full[:, -WIDTH - 1 : -1]  # [B, C, V]: position t predicts token t + 1
    entropies = {}
    for temperature in (0.5, 1.5):
        scored = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature, full_logits=full_logits)
        logp = (predicting / temperature).log_softmax(-1)
        manual_logprobs = logp.gather(-1, input_ids[:, -WIDTH:].unsqueeze(-1)).squeeze(-1)
        manual_entropy = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(scored.logprobs, manual_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(scored.entropy, manual_entropy, atol=1e-5, rtol=0)
        entropies[temperature] = scored.entropy
    assert (entropies[1.5] > entropies[0.5] + 1e-4).all()  # a hotter distribution is more uncertain


@torch.no_grad()
def test_i11_logprobs_alone_equal_inside_padded_batch(tiny_model, tiny_tokenizer):
    input_ids, attention_mask, completion_mask, rows = completion_batch(tiny_tokenizer)
    assert attention_mask[:, 0].eq(0).any()  # the batch really is left-padded
    batch = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature=0.7)
    for i, (ids, mask) in enumerate(rows):
        alone = score_completions(tiny_model, ids, mask, WIDTH, temperature=0.7)
        keep = completion_mask[i]
        torch.testing.assert_close(batch.logprobs[i][keep], alone.logprobs[0][keep], atol=1e-5, rtol=0)
        torch.testing.assert_close(batch.entropy[i][keep], alone.entropy[0][keep], atol=1e-5, rtol=0)


@torch.no_grad()
def test_i11_garbage_in_padded_positions_changes_nothing(tiny_model, tiny_tokenizer):
    input_ids, attention_mask, completion_mask, _ = completion_batch(tiny_tokenizer)
    clean = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature=1.0)
    garbage = torch.randint(0, len(tiny_tokenizer), input_ids.shape, generator=torch.Generator().manual_seed(3))
    dirty_ids = torch.where(attention_mask.bool(), input_ids, garbage)
    assert not torch.equal(dirty_ids, input_ids)
    dirty = score_completions(tiny_model, dirty_ids, attention_mask, WIDTH, temperature=1.0)
    torch.testing.assert_close(dirty.logprobs[completion_mask], clean.logprobs[completion_mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(dirty.entropy[completion_mask], clean.entropy[completion_mask], atol=1e-6, rtol=0)


def test_score_completions_works_with_peft_model(tiny_model, tiny_tokenizer):
    from grpo.config import LoraConfig
    from grpo.model.lora import wrap_lora

    input_ids, attention_mask, completion_mask, _ = completion_batch(tiny_tokenizer)
    with torch.no_grad():
        base = score_completions(tiny_model, input_ids, attention_mask, WIDTH, temperature=1.0)
    peft_model = wrap_lora(tiny_model, LoraConfig(enabled=True, r=2, alpha=4))
    scored = score_completions(peft_model, input_ids, attention_mask, WIDTH, temperature=1.0)
    # A fresh adapter is zero (LoRA B = 0): the same distribution as the base model.
    torch.testing.assert_close(scored.logprobs, base.logprobs, atol=1e-6, rtol=0)
    scored.logprobs[completion_mask].sum().backward()
    lora_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
