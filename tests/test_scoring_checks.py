"""grpo/checks/scoring_checks.py on the gate's small random model (fast): each check passes on the stage code
and fails on the bug it is about, planted where the check drives the stage function, including where a lax
check would not look (a NaN, the entropy beside the log-probs, a temperature other than the configured 1, an
uncounted group). tests/test_preflight.py runs the whole gate on the tiny project (slow)."""

from __future__ import annotations

import dataclasses

from grpo.checks import scoring_checks as sc
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
