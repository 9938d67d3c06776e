"""grpo/train/agreement.py: the step holds its scorer to what the decode computed for every token it drew, and
the first step of a fresh run to its reference, before any weight moves.

| broken on purpose | what the step says |
| --- | --- |
| kept rows decode against another prompt's keys and values (``prefix.decode_cache``'s order not inverted) | I10 |
| a drawn stop token written as another id | I3 |
| a temperature applied twice on the sampling side only | I10 (reshaped, no penalty configured) |
| the completion mask not ending at the drawn stop | I5 |
| a reference that is not the policy at the first step | I9 |
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper

from grpo.model.fast import decode as loop
from grpo.model.generation import SamplerRecord
from grpo.model.precision import cpu_has_native_bf16
from grpo.train.agreement import (
    LOGPROB_BOUND,
    StepInvariantError,
    first_step_problem,
    runs_bf16,
    sampler_problem,
    token_bounds,
)
from grpo.train.step import grpo_step
from tests.steps import decode_cache_by_the_permutation, make_step, step_records
from tests.weights import fill_adapter


def _records() -> list[dict]:
    """Four prompts whose tasks interleave (fairness, hallucination, hallucination, fairness): the kept
    prefill's rows, one forward per task, come in an order that is not its own inverse."""
    f0, f1, h0, h1 = step_records()
    return [f0, h0, h1, f1]


def _weights(step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.params]


def _unchanged(step, before) -> bool:
    return all(torch.equal(p, b) for p, b in zip(step.params, before, strict=True))


@pytest.mark.parametrize("fast_paths", ["auto", "off"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
                                      {"presence_penalty": 0.8, "frequency_penalty": 0.4, "min_new_tokens": 3}],
                         ids=["plain", "warped", "penalised"])
def test_the_sampler_and_the_scorer_agree_on_a_correct_step(tiny_model, tiny_tokenizer, fast_paths, sampling):
    """Every step logs the gap (TRL's names) within its bound, with the decode loop and with ``generate``; a
    penalty reshapes some positions, which are still compared (the scored log-prob ignores the processors)."""
    step = make_step(tiny_model, tiny_tokenizer, fast_paths=fast_paths, sampling={"max_new_tokens": 5, **sampling})
    metrics = grpo_step(step, _records(), 1, lambda attempt: _records(), first=True).metrics
    assert 0 <= metrics["sampling/sampling_logp_difference/mean"] <= metrics["sampling/sampling_logp_difference/max"]
    assert metrics["sampling/sampling_logp_difference/max_over_bound"] < 0.1, "far inside the fp32 bound"
    assert (metrics["sampling/reshaped_frac"] > 0) == ("presence_penalty" in sampling)


def test_two_updates_hold_the_stored_old_logprobs_to_the_sampler(tiny_model, tiny_tokenizer):
    step = make_step(tiny_model, tiny_tokenizer, num_iterations=2)
    metrics = grpo_step(step, _records(), 1, lambda attempt: _records(), first=True).metrics
    assert metrics["sampling/sampling_logp_difference/max_over_bound"] < 0.1


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 autocast runs on a CPU with native bf16 only")
def test_bf16_autocast_steps_agree_within_the_bf16_bound(tiny_model, tiny_tokenizer):
    """Under bf16 autocast the bound is eight bf16 steps of each position's largest scaled logit, and a correct
    step stays inside it."""
    step = make_step(tiny_model, tiny_tokenizer, bf16=True)
    assert runs_bf16(step)
    metrics = grpo_step(step, _records(), 1, lambda attempt: _records(), first=True).metrics
    assert 0 < metrics["sampling/sampling_logp_difference/max_over_bound"] < 1


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_has_native_bf16(), reason="bf16 autocast runs on a CPU with native bf16 only"))], ids=["fp32", "bf16"])
def test_tokens_decoded_against_another_prompts_cache_stop_the_step(tiny_model, tiny_tokenizer, monkeypatch, bf16):
    """The kept prefill mapped to the decode's rows without inverting its order: rows decode against other
    prompts' keys and values, with exact ids and masks; the step stops before its update, naming I10 (under
    bf16 too: its wider bound is far below the gap of another prompt's context)."""

    step = make_step(tiny_model, tiny_tokenizer, bf16=bf16)
    assert step.reuses_prefill, "the rollout keeps its prefill for the update (the path the slip is in)"
    monkeypatch.setattr("grpo.model.rollout.decode_cache", decode_cache_by_the_permutation)
    before = _weights(step)
    with pytest.raises(StepInvariantError, match=r"step 1 stopped before its update: rows .*I10") as caught:
        grpo_step(step, _records(), 1, lambda attempt: _records())
    assert caught.value.invariant == "I10" and _unchanged(step, before)


def test_a_drawn_token_written_as_another_id_stops_the_step(tiny_model, tiny_tokenizer, monkeypatch):
    """The decode wrote another id than the one it drew (as a loop that writes the pad id over a drawn stop
    token, where the row then runs on as truncated): the ids the step scores are not the drawn ids (I3),
    after a row's stop too."""
    step = make_step(tiny_model, tiny_tokenizer)
    word = 300
    original = loop.decode

    def forced(*args, **kwargs):
        sequences = original(*args, **kwargs).clone()
        sequences[0, -1] = word  # the last column of row 0, after the loop recorded what it drew
        return sequences

    monkeypatch.setattr(loop, "decode", forced)
    assert word not in step.eos_ids
    with pytest.raises(StepInvariantError, match=rf"row 0, column \d+: drew \d+, scored {word}") as caught:
        grpo_step(step, _records(), 1, lambda attempt: _records())
    assert caught.value.invariant == "I3"


def test_a_temperature_applied_twice_on_the_sampling_side_stops_the_step(tiny_model, tiny_tokenizer, monkeypatch):
    """The scorer divides by T once, the sampler twice: the drawn distribution is not ``softmax(z / T)`` up to
    masking, with no penalty configured (I10)."""
    original = loop.warpers

    def twice(sampling, greedy):
        out = original(sampling, greedy)
        out.insert(0, TemperatureLogitsWarper(sampling.temperature))
        return out

    monkeypatch.setattr(loop, "warpers", twice)
    step = make_step(tiny_model, tiny_tokenizer, sampling={"max_new_tokens": 5, "temperature": 0.7})
    with pytest.raises(StepInvariantError, match="distribution other than softmax") as caught:
        grpo_step(step, _records(), 1, lambda attempt: _records())
    assert caught.value.invariant == "I10"


def test_the_first_step_refuses_a_policy_that_is_not_its_reference(tiny_model, tiny_tokenizer):
    """At the first step of a fresh run the policy must be its reference (I9); later steps (``first`` False)
    train a moved policy as they should."""
    step = make_step(tiny_model, tiny_tokenizer, loss={"beta": 0.0})
    fill_adapter(step.model, torch.Generator().manual_seed(0))  # the adapter moved: KL > 0 against the SFT weights
    before = _weights(step)
    with pytest.raises(StepInvariantError, match=r"step 1 stopped before its update: .*KL .*\(I9\)") as caught:
        grpo_step(step, _records(), 1, lambda attempt: _records(), first=True)
    assert caught.value.invariant == "I9" and _unchanged(step, before)
    later = grpo_step(step, _records(), 2, lambda attempt: _records()).metrics
    assert later["sampling/sampling_logp_difference/max_over_bound"] < 0.1


def _record(ids, scored, reshaped=None) -> SamplerRecord:
    ids, scored = torch.tensor(ids), torch.tensor(scored)
    reshaped = torch.zeros_like(ids, dtype=torch.bool) if reshaped is None else torch.tensor(reshaped)
    return SamplerRecord(ids, scored, scored, reshaped, torch.ones_like(scored))


@pytest.mark.parametrize(
    "ids, scored, reshaped, penalised, invariant",
    [
        ([[5, 1, 0]], [[-1.0, -2.0, 0.0]], None, False, None),  # agrees: stop id 1, pad 0 after it
        ([[5, 1, 0]], [[-1.0, -2.0, 0.0]], [[False, True, False]], True, None),  # a penalty reshaped: allowed
        ([[5, 7, 0]], [[-1.0, -2.0, 0.0]], None, False, "I3"),  # scored 1 where 7 was drawn
        ([[5, 1, 0]], [[-1.0, -2.1, 0.0]], None, False, "I10"),  # 0.1 nats apart
        ([[5, 1, 0]], [[-1.0, -2.0, 0.0]], [[False, True, False]], False, "I10"),  # reshaped, no penalty
        ([[5, 1, 0]], [[-1.0, float("nan"), 0.0]], None, False, "I10"),  # the sampler's log-prob NaN
        ([[5, 1, 0]], [[-1.0, -2.0, float("nan")]], None, False, None),  # NaN after the stop: not scored
    ],
)
def test_sampler_problem_names_the_invariant(ids, scored, reshaped, penalised, invariant):
    """The table above, on hand-made tensors: stop id 1, the step scores ids [5, 1, 0] with log-probs
    [-1, -2, 0] and the mask [1, 1, 0]."""
    record = _record(ids, scored, reshaped)
    step_ids, mask = torch.tensor([[5, 1, 0]]), torch.tensor([[True, True, False]])
    bounds = token_bounds(record.scale, 1.0, bf16=False)
    found = sampler_problem(record, step_ids, mask, torch.tensor([[-1.0, -2.0, 0.0]]), [1], penalised, bounds)
    assert (found and found[0]) == invariant, found
    wrong_mask = sampler_problem(_record([[5, 1, 0]], [[-1.0, -2.0, 0.0]]), step_ids, torch.ones(1, 3, dtype=torch.bool),
                                 torch.tensor([[-1.0, -2.0, 0.0]]), [1], False, bounds)
    assert wrong_mask[0] == "I5"


def test_token_bounds_are_fp32s_or_eight_bf16_steps_of_the_largest_scaled_logit():
    scale = torch.tensor([[0.01, 10.0, 40.0]])
    torch.testing.assert_close(token_bounds(scale, 1.0, False), torch.full((1, 3), LOGPROB_BOUND))
    torch.testing.assert_close(token_bounds(scale, 0.5, False), torch.full((1, 3), 2 * LOGPROB_BOUND))
    torch.testing.assert_close(token_bounds(scale, 1.0, True), torch.tensor([[1e-3, 8 * 2**-8 * 10, 8 * 2**-8 * 40]]))


def test_first_step_problem_reads_the_reference_then_the_old_logprobs():
    policy, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
    bounds = torch.full((1, 2), LOGPROB_BOUND)
    assert first_step_problem(policy, policy.clone(), policy.clone(), mask, bounds) is None
    assert first_step_problem(policy, policy - 0.5, None, mask, bounds)[0] == "I9"
    assert first_step_problem(policy, policy.clone(), policy + 0.01, mask, bounds)[0] == "I8"
    assert first_step_problem(policy, None, None, mask, bounds) is None


def test_a_frequency_penalty_alone_lets_the_reshaped_tokens_through(tiny_model, tiny_tokenizer):
    """``frequency_penalty`` without ``presence_penalty`` reshapes the logits as much: either penalty is a
    configured reshaping, not the I10 slip of a processor that should not be there."""
    step = make_step(tiny_model, tiny_tokenizer, sampling={"max_new_tokens": 5, "frequency_penalty": 2.0})
    metrics = grpo_step(step, _records(), 1, lambda attempt: _records(), first=True).metrics
    assert metrics["sampling/reshaped_frac"] > 0


def test_weights_loaded_in_bf16_round_in_bf16_without_autocast():
    """``grpo.bf16: false`` with bf16 weights still rounds every matmul to bf16: the step gets the bf16 bound."""
    from types import SimpleNamespace

    from grpo.config import config_from_dict

    cfg = config_from_dict({"grpo": {"bf16": False}})
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    for dtype, expected in ((torch.bfloat16, True), (torch.float32, False)):
        step = SimpleNamespace(model=torch.nn.Linear(2, 2).to(dtype), accelerator=accelerator, cfg=cfg)
        assert runs_bf16(step) is expected, dtype


def test_agreement_stats_read_only_the_completion_tokens():
    """After the stop the sampler's and the scorer's numbers are whatever the padding holds: not a mismatch."""
    from grpo.train.agreement import agreement_stats

    record = _record([[5, 1, 0]], [[-1.0, -2.0, -9.0]], [[False, False, True]])
    mask = torch.tensor([[True, True, False]])
    stats = agreement_stats(record, mask, torch.tensor([[-1.0, -2.5, 0.0]]), torch.full((1, 3), 0.1))
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(0.25)
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert stats["sampling/sampling_logp_difference/max_over_bound"] == pytest.approx(5.0)
    assert stats["sampling/reshaped_frac"] == 0.0


def test_a_sampler_record_pads_as_after_a_stop_token():
    """Widened to the batch's completion width: pad ids, log-probs and scale 0, no reshaping."""
    scored = torch.tensor([[-0.5, -1.0], [-0.25, -2.0], [-1.5, -0.5]])  # 3 rows of 2 tokens
    record = SamplerRecord(torch.tensor([[7, 8], [9, 10], [11, 12]]), scored, scored - 1,
                           torch.tensor([[True, False]] * 3), torch.full((3, 2), 3.0))
    padded = record.padded(4, pad_id=2)
    assert [tuple(t.shape) for t in padded] == [(3, 4)] * 5
    assert padded.ids[:, 2:].tolist() == [[2, 2]] * 3 and torch.equal(padded.ids[:, :2], record.ids)
    for values, fill in zip(padded[1:], (0.0, 0.0, False, 0.0), strict=True):
        assert (values[:, 2:] == fill).all()
    assert torch.equal(padded.scored[:, :2], scored - 1) and torch.equal(record.padded(2, pad_id=2).ids, record.ids)
