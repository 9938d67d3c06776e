"""grpo/checks/scoring_checks.py on the gate's small random model (fast): each check passes on the stage code
and fails on the bug it is about, planted where the check drives the stage function, including where a lax
check would not look (a NaN, the entropy beside the log-probs, a temperature other than the configured 1, an
uncounted group). tests/test_preflight.py runs the whole gate on the tiny project (slow)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from grpo.checks import scoring_checks as sc
from grpo.config import config_from_dict
from grpo.model.scoring import RolloutInputs
from tests import gate_subjects

records, subject = gate_subjects.records, gate_subjects.subject  # the gate's fixtures, defined once


def test_a_nan_kl_to_the_reference_fails(subject, monkeypatch):
    monkeypatch.setattr(sc, "reference_kl", lambda *args, **kwargs: float("nan"))
    check = sc.check_ratio_kl_reference(subject)
    assert check.status == "fail" and "KL to the reference is 0 with a perturbed policy (I9)" in check.detail


def test_a_nan_gap_to_the_sft_weights_or_to_the_base_fails(subject, tiny_tokenizer, monkeypatch):
    """A reference scored as NaN is neither "equal to the SFT weights" nor "different from the base"."""
    with_base = dataclasses.replace(subject, base=gate_subjects.random_model_for(tiny_tokenizer))
    nan = float("nan")
    monkeypatch.setattr(sc, "_fresh_gap", lambda s, model, batch: nan)
    check = sc.check_ratio_kl_reference(with_base)
    assert check.status == "fail" and "the reference is not the SFT weights (I9)" in check.detail
    monkeypatch.setattr(sc, "_fresh_gap", lambda s, model, batch: nan if model is s.base else 0.0)
    check = sc.check_ratio_kl_reference(with_base)
    assert check.status == "fail" and "the reference equals the pre-SFT base (I9)" in check.detail


def _untempered(field: str):
    """``score_inputs`` whose ``field`` (logprobs or entropy) is that of ``softmax(z)``, whatever the temperature."""
    score = sc.score_inputs

    def scored(model, inputs, **kwargs):
        right = score(model, inputs, **kwargs)
        plain = RolloutInputs(inputs.input_ids, inputs.attention_mask, inputs.completion_mask, 1.0)
        return right._replace(**{field: getattr(score(model, plain, **kwargs), field)})

    return scored


def test_the_temperature_check_probes_a_temperature_off_one_and_reads_the_entropy(subject, monkeypatch):
    """At the configured T = 1 a scorer that never divides by T is right; the check also scores at 0.5, and
    compares the entropy as well as the log-probs."""
    assert subject.cfg.grpo.sampling.temperature == 1.0
    assert sc.check_temperature(subject).status == "pass"
    for field in ("logprobs", "entropy"):
        monkeypatch.setattr(sc, "score_inputs", _untempered(field))
        check = sc.check_temperature(subject)
        assert check.status == "fail" and "T=0.5" in check.detail, field
        monkeypatch.undo()


def test_the_temperature_bound_is_the_tolerance_or_twice_fp32s_own_rounding_of_the_formula(subject, monkeypatch):
    """The bound widens only to what torch's fp32 log-softmax and entropy round by on the very logits checked
    (a 152k vocabulary on an AVX2 CPU: 1.4e-4 nats), never to the size of a formula's bug."""
    check = sc.check_temperature(subject)
    rounding = float(check.detail.rsplit("formula there: ", 1)[1].rstrip(")"))
    assert 0 < rounding < 1e-4 and check.bound == max(subject.tolerance(), 2 * rounding)
    formula = sc._formula
    monkeypatch.setattr(sc, "_formula", lambda *args: (*formula(*args)[:3], 3e-3))  # a CPU that rounds badly
    check = sc.check_temperature(subject)
    assert check.status == "pass" and check.bound == 6e-3
    monkeypatch.setattr(sc, "score_inputs", _untempered("entropy"))
    assert sc.check_temperature(subject).status == "fail"  # T's bug is far beyond any fp32 rounding


def test_the_entropy_sign_check_passes_the_step_and_fails_a_flipped_bonus(subject, monkeypatch):
    assert sc.check_entropy_sign(subject).status == "pass"
    gradient = sc.gradient
    monkeypatch.setattr(sc, "gradient", lambda *args: (lambda g: g._replace(direction=-g.direction))(gradient(*args)))
    check = sc.check_entropy_sign(subject)
    assert check.status == "fail" and check.value < 0


def _advantages_with(change):
    """``group_advantages`` with ``change(advantages, stats, equal)`` applied, ``equal`` marking equal-reward rows."""
    plain = sc.group_advantages

    def advantages(rewards, group, scale, **kwargs):
        out, stats = plain(rewards, group, scale, **kwargs)
        groups = rewards.view(-1, group)
        equal = (groups == groups[:, :1]).all(-1).repeat_interleave(group)
        return change(out.clone(), dict(stats), equal)

    return advantages


def test_the_zero_variance_check_fails_nan_advantages_and_uncounted_groups(subject, monkeypatch):
    assert sc.check_zero_variance_groups(subject).status == "pass"
    monkeypatch.setattr(sc, "group_advantages", _advantages_with(
        lambda out, stats, equal: (out.masked_fill(equal, float("nan")), stats)))
    assert sc.check_zero_variance_groups(subject).status == "fail"
    monkeypatch.setattr(sc, "group_advantages", _advantages_with(
        lambda out, stats, equal: (out, stats | {"frac_reward_zero_std": 0.0})))
    check = sc.check_zero_variance_groups(subject)
    assert check.status == "fail" and "frac_reward_zero_std 0.0" in check.detail


def test_the_ratio_kl_reference_check_passes_the_step_within_its_stated_bounds(subject):
    """On the stage code every number is inside the bound the report states beside it: the fresh SFT weights
    to a tenth of the tolerance, a positive KL, a one-token change that stays on its token with ratio exp(0.1)."""
    check = sc.check_ratio_kl_reference(subject)
    same = subject.tolerance() / 10
    assert check.status == "pass" and check.hint == "", check.detail
    assert check.bound == {"ref_vs_fresh_sft": same, "ref_vs_base": f"> {same:g}", "kl_perturbed": "> 0",
                           "other_tokens_ratio_kl_change": 1e-6, "own_ratio_error": 1e-5}
    numbers = check.value
    assert numbers["ref_vs_fresh_sft"] <= same and numbers["ref_vs_base"] is None and numbers["kl_perturbed"] > 0
    assert numbers["other_tokens_ratio_kl_change"] <= 1e-6 and numbers["own_ratio_error"] <= 1e-5


def test_a_reference_off_the_sft_weights_at_one_token_fails_i9(subject, monkeypatch):
    """The step's reference log-probs compared with a fresh load of the SFT weights token by token: one token
    scored otherwise (a row's reference read one position off) fails, the gap being the largest, not a typical one."""
    draw = sc.step_batch

    def planted(*args, **kwargs):
        batch, sampled = draw(*args, **kwargs)
        return dataclasses.replace(batch, ref_logprobs=_one_token_off(batch.ref_logprobs)), sampled

    monkeypatch.setattr(sc, "step_batch", planted)
    check = sc.check_ratio_kl_reference(subject)
    assert check.status == "fail" and "the reference is not the SFT weights (I9)" in check.detail
    assert check.value["ref_vs_fresh_sft"] >= 0.04


def test_a_kl_of_exactly_zero_to_the_reference_fails(subject, monkeypatch):
    """A policy scored against itself (the reference left on the adapter) gives KL 0, not NaN: that fails too."""
    monkeypatch.setattr(sc, "reference_kl", lambda *args, **kwargs: 0.0)
    check = sc.check_ratio_kl_reference(subject)
    assert check.status == "fail" and "KL to the reference is 0 with a perturbed policy (I9)" in check.detail


def _spread(values, mask, over):
    """``values`` [N, C] replaced by their masked mean over each row (``row``) or the whole batch (``batch``)."""
    weights = mask.float()
    if over == "row":
        mean = (values * weights).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp_min(1)
        return mean.expand_as(values)
    return ((values * weights).sum() / weights.sum().clamp_min(1)).expand_as(values)


def test_a_ratio_or_kl_of_a_sequence_or_batch_mean_fails_i8(subject, monkeypatch):
    """The per-token I8 probe against the forms that spread one token's change: a ratio of the mean log-ratio
    of the row (GSPO's sequence ratio where a token ratio is due) or of the batch, a KL averaged likewise.
    Each of the ratio and the KL is planted alone: the check reads both."""
    surrogate, kl = sc.clipped_surrogate, sc.k3_kl

    def spread_ratio(over):
        def planted(logprobs, old, advantages, mask, *args, **kwargs):
            tokens = surrogate(logprobs, old, advantages, mask, *args, **kwargs)
            return tokens._replace(ratio=torch.exp(_spread(logprobs - old, mask, over)))
        return planted

    def spread_kl(over):
        return lambda logprobs, ref, mask: _spread(kl(logprobs, ref, mask), mask, over)

    for name, attr, planted in (("row ratio", "clipped_surrogate", spread_ratio("row")),
                                ("batch ratio", "clipped_surrogate", spread_ratio("batch")),
                                ("row KL", "k3_kl", spread_kl("row")), ("batch KL", "k3_kl", spread_kl("batch"))):
        monkeypatch.setattr(sc, attr, planted)
        check = sc.check_ratio_kl_reference(subject)
        assert check.status == "fail", name
        assert "a one-token change moved other tokens' ratio or KL (I8)" in check.detail, name
        assert check.value["other_tokens_ratio_kl_change"] > 1e-4, name  # a hundred times the bound
        monkeypatch.undo()


def test_a_nan_ratio_fails_i8(subject, monkeypatch):
    """A ratio that is NaN off the changed token is no evidence of a per-token ratio."""
    surrogate = sc.clipped_surrogate

    def planted(logprobs, old, *args, **kwargs):
        tokens = surrogate(logprobs, old, *args, **kwargs)
        return tokens._replace(ratio=tokens.ratio.masked_fill(logprobs == old, float("nan")))

    monkeypatch.setattr(sc, "clipped_surrogate", planted)
    check = sc.check_ratio_kl_reference(subject)
    assert check.status == "fail" and "moved other tokens' ratio or KL (I8)" in check.detail


def test_the_temperature_check_probes_one_when_the_configured_temperature_is_not_one(tiny_tokenizer, records):
    """At T = 0.7 the second temperature probed is 1.0, and the stage code passes at both (completions 6 wide, not
    as many as the rows: the formula reads the completion width, not the row count)."""
    cfg = config_from_dict({**gate_subjects.CFG.model_dump(mode="json"),
                            "grpo": {**gate_subjects.CFG.grpo.model_dump(mode="json"),
                                     "sampling": {**gate_subjects.CFG.grpo.sampling.model_dump(mode="json"),
                                                  "temperature": 0.7, "max_new_tokens": 6}}})
    s = gate_subjects.subject_for(cfg, gate_subjects.random_model_for(tiny_tokenizer), tiny_tokenizer, records)
    check = sc.check_temperature(s)
    assert check.status == "pass", check.detail
    assert "'T=0.7'" in check.detail and "'T=1.0'" in check.detail


def test_a_rollout_that_records_another_temperature_fails(subject, monkeypatch):
    """The rollout must say the temperature it sampled at, and the scored inputs carry it: either one wrong fails."""
    draw = sc.step_batch

    def misrecorded(field):
        def planted(*args, **kwargs):
            batch, sampled = draw(*args, **kwargs)
            if field == "rollout":
                sampled = dataclasses.replace(sampled, rollout=dataclasses.replace(sampled.rollout, temperature=1.0))
            else:
                batch = dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, temperature=1.0))
            return batch, sampled
        return planted

    for field in ("rollout", "inputs"):
        monkeypatch.setattr(sc, "step_batch", misrecorded(field))
        check = sc.check_temperature(subject)
        assert check.status == "fail" and "the rollout did not record T=[0.5]" in check.detail, field
        assert check.hint == "the rollout must record the temperature it sampled at", field
        monkeypatch.undo()


def _one_token_off(tensor, by=0.05):
    """``tensor`` [N, C] with its first row's first column moved by ``by`` (an off-by-one at one position)."""
    out = tensor.clone()
    out[0, 0] += by
    return out


def test_the_temperature_check_fails_a_gap_at_one_token(subject, monkeypatch):
    """One token's stored log-prob, fresh log-prob or entropy off the written formula fails: the gap is the largest
    over the tokens, not a typical one."""
    draw, score = sc.step_batch, sc.score_inputs

    def stored_off(*args, **kwargs):
        batch, sampled = draw(*args, **kwargs)
        return dataclasses.replace(batch, old_logprobs=_one_token_off(batch.old_logprobs)), sampled

    def scored_off(field):
        def planted(*args, **kwargs):
            scored = score(*args, **kwargs)
            return scored._replace(**{field: _one_token_off(getattr(scored, field))})
        return planted

    for name, attr, planted in (("stored log-probs", "step_batch", stored_off),
                                ("fresh log-probs", "score_inputs", scored_off("logprobs")),
                                ("entropy", "score_inputs", scored_off("entropy"))):
        monkeypatch.setattr(sc, attr, planted)
        check = sc.check_temperature(subject)
        assert check.status == "fail" and check.value >= 0.04, (name, check.detail)
        monkeypatch.undo()


def test_the_entropy_sign_check_gives_its_hint_only_when_it_fails(subject, monkeypatch):
    check = sc.check_entropy_sign(subject)
    assert check.status == "pass" and check.hint == "" and check.bound == f"> {sc.ENTROPY_TOL}"
    gradient = sc.gradient
    monkeypatch.setattr(sc, "gradient", lambda *args: (lambda g: g._replace(direction=-g.direction))(gradient(*args)))
    assert "its sign is flipped (I7)" in sc.check_entropy_sign(subject).hint


def test_the_overflowing_reward_is_finite_and_two_copies_of_it_overflow_in_fp32():
    value = torch.tensor([sc.OVERFLOWING] * 2, dtype=torch.float32)
    assert bool(torch.isfinite(value).all()) and not bool(torch.isfinite(value.sum()))


def test_inexact_value_is_a_reward_whose_fp32_mean_of_equal_copies_differs_and_none_at_one_or_two():
    """Found by trying, not assumed: which sizes have an inexact value depends on the CPU's summation kernel
    (here 0.1 is exact at 3 and not at 8); one copy, or two (x + x is exact), never have one."""
    for group in (3, 5, 6, 7, 12):
        value = sc.inexact_value(group)
        assert value is not None, group
        same = torch.full((1, group), value)
        assert bool((same - same.mean(-1, keepdim=True)).any()), group
    for group in (1, 2):
        assert sc.inexact_value(group) is None, group


def _expected_batch_names(group):
    names = []
    for g in dict.fromkeys((group, 3)):
        value = sc.inexact_value(g)
        if value is not None:
            names += [f"G={g} x {value} alone", f"G={g} x {value} beside a mixed group"]
    return names + ([f"G={group} x {sc.OVERFLOWING:.3g} alone"] if group > 1 else [])


def test_the_equal_reward_batches_cover_the_group_size_three_and_an_overflow():
    """Each inexact value alone and beside a mixed group, at the configured group size and at 3 (where a CPU's
    one-group kernel gives a nonzero std of equal rewards), and the overflowing reward at a group size above 1."""
    assert sc.inexact_value(3) is not None and sc.inexact_value(6) is not None  # the batches below hold them
    for group in (1, 2, 3, 4, 6):
        assert list(sc._equal_reward_batches(group)) == _expected_batch_names(group), group
    assert any(name.startswith("G=3 ") for name in sc._equal_reward_batches(6))
    value = sc.inexact_value(6)
    rewards, group = sc._equal_reward_batches(6)[f"G=6 x {value} beside a mixed group"]
    assert group == 6 and torch.equal(rewards[:6], torch.full((6,), value))
    assert torch.equal(rewards[6:], torch.tensor([0.1, 0.2, 0.7, 0.1, 0.2, 0.7]))
    overflow, group = sc._equal_reward_batches(2)[f"G=2 x {sc.OVERFLOWING:.3g} alone"]
    assert group == 2 and torch.equal(overflow, torch.full((2,), sc.OVERFLOWING))


def test_the_zero_variance_check_fails_a_mixed_group_that_loses_its_signal(subject, monkeypatch):
    """Advantages of exactly 0 everywhere (a mask that takes every group), NaN in the mixed group or one infinite
    advantage there (a std of a near-equal group divided into) fail, with
    the hint to count the groups; the check's bound is exactly 0."""
    check = sc.check_zero_variance_groups(subject)
    assert check.status == "pass" and check.bound == 0.0 and check.hint == ""
    for name, change in (("zeroed", lambda out, stats, equal: (torch.zeros_like(out), stats)),
                         ("NaN", lambda out, stats, equal: (out.masked_fill(~equal, float("nan")), stats)),
        ("one inf", lambda out, stats, equal: (out.masked_fill(~equal & (torch.cumsum(~equal, 0) == 1), float("inf")),
                                                stats))):
        monkeypatch.setattr(sc, "group_advantages", _advantages_with(change))
        check = sc.check_zero_variance_groups(subject)
        assert check.status == "fail" and "the mixed group lost its signal" in check.detail, name
        assert check.hint == "count equal-reward groups in frac_reward_zero_std", name
        monkeypatch.undo()


def test_the_sampling_processors_check_passes_plain_sampling_and_warns_on_each_processor():
    """The configured default's ``min_new_tokens: 1`` warns; plain softmax(z / T) passes."""
    def subject_with(**fields):
        sampling = gate_subjects.CFG.grpo.sampling.model_copy(update={"min_new_tokens": 0, **fields})
        return SimpleNamespace(cfg=SimpleNamespace(grpo=SimpleNamespace(sampling=sampling)))

    assert sc.check_sampling_processors(SimpleNamespace(cfg=gate_subjects.CFG)).value == ["min_new_tokens=1"]
    check = sc.check_sampling_processors(subject_with())
    assert check.status == "pass" and check.value == []
    for field, value in (("top_p", 0.9), ("top_k", 5), ("min_new_tokens", 1), ("presence_penalty", 0.1)):
        check = sc.check_sampling_processors(subject_with(**{field: value}))
        assert check.status == "warn" and check.value == [f"{field}={value}"], field
