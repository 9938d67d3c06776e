"""grpo/checks/behaviour.py: the checks that watch what the stage code does, each passing on the right code
and failing on a bug written where the function-level checks do not look."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.checks.behaviour import (
    biased,
    check_first_step,
    check_processors_see_completion,
    check_sft_ends_answers,
    check_sft_supervises_stop,
)
from grpo.config import config_from_dict
from grpo.model import rollout as rollout_module
from grpo.train import causal_lm
from tests import gate_subjects
from tests.gate_subjects import CFG, FULL, random_model_for, subject_for

records, subject = gate_subjects.records, gate_subjects.subject  # the gate's fixtures, defined once


def test_the_sft_batch_check_sees_the_loop_drop_the_stop_token(subject, monkeypatch):
    assert check_sft_supervises_stop(subject).status == "pass"
    original = causal_lm.sft_loss

    def without_the_last_position(model, batch):  # the loop's loss mask loses each conversation's stop token
        mask = batch.loss_mask.clone()
        mask[:, -1] = False
        return original(model, batch._replace(loss_mask=mask))

    monkeypatch.setattr(causal_lm, "sft_loss", without_the_last_position)
    check = check_sft_supervises_stop(subject)
    assert check.status == "fail" and check.value == 2


def test_an_sft_model_that_stops_passes_and_one_that_never_does_fails(subject):
    """A random model never ends its answers; the same model biased towards its end-of-turn token does."""
    never = check_sft_ends_answers(subject)
    assert never.status == "fail" and never.value < 0.5
    with biased(subject.sft, [subject.eos_ids[0]]):
        ends = check_sft_ends_answers(subject)
    assert ends.status == "pass" and ends.value == 1.0


def test_the_ended_share_is_held_to_preflight_min_ended_share(tiny_tokenizer, records):
    """At ``min_ended_share: 0`` (the check as a report only) a model that never stops passes."""
    cfg = config_from_dict({**CFG.model_dump(mode="json"), "preflight": {"min_ended_share": 0.0}})
    check = check_sft_ends_answers(subject_for(cfg, random_model_for(tiny_tokenizer), tiny_tokenizer, records))
    assert check.status == "pass" and check.value == 0.0 and check.bound == ">= 0.0 (preflight.min_ended_share)"


def test_the_processors_check_sees_a_rollout_built_with_another_prompt_width(subject, monkeypatch):
    assert check_processors_see_completion(subject).status == "pass"
    build = rollout_module.build_logits_processors
    monkeypatch.setattr(rollout_module, "build_logits_processors",
                        lambda width, eos_ids, sampling: build(width - 3, eos_ids, sampling))
    check = check_processors_see_completion(subject)
    assert check.status == "fail" and check.value == 3  # both penalties and EOS suppression
    assert "counted prompt tokens" in check.detail


def test_the_first_step_check_sees_a_reference_that_is_not_the_policy(tiny_tokenizer, records):
    """Full fine-tuning against a frozen copy of the weights: ratio 1 and KL 0 at the first step; against a
    copy of other weights (a pre-SFT base as the trainer's reference, I9): KL > 0."""
    model = random_model_for(tiny_tokenizer)
    right = subject_for(FULL, model, tiny_tokenizer, records, reference=copy.deepcopy(model).requires_grad_(False))
    check = check_first_step(right)
    assert check.status == "pass" and check.value == 0.0
    other = random_model_for(tiny_tokenizer)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    model = random_model_for(tiny_tokenizer)
    wrong = subject_for(FULL, model, tiny_tokenizer, records, reference=other.requires_grad_(False))
    before = [p.detach().clone() for p in wrong.step.params]
    check = check_first_step(wrong)
    # The step's own first-step check refuses before the update, naming the reference's invariant.
    assert check.status == "fail" and "I9" in check.invariant and "I9" in check.detail, check
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.step.params, strict=True))  # the gate trains nothing
    assert not wrong.step.optimizer.state


def test_the_ended_share_is_of_the_eval_questions_decoded_greedily(subject, monkeypatch):
    """The SFT model answers the eval questions (not the training probes it was taught on), greedily: the
    verdict must not depend on sampling luck."""
    from grpo.checks import behaviour

    questions = subject.records[:1]
    assert len(subject.records) > 1
    asked = dataclasses.replace(subject, questions=questions)
    assert check_sft_ends_answers(asked).detail.startswith("1 prompts, greedy:")
    seen = []
    generate = behaviour.generate_rollout
    monkeypatch.setattr(behaviour, "generate_rollout",
                        lambda *args, **kwargs: seen.append(kwargs["greedy"]) or generate(*args, **kwargs))
    check_sft_ends_answers(asked)
    assert seen == [True]


def test_the_first_step_metrics_must_be_ratio_one_and_kl_zero_both_ways(subject, monkeypatch):
    """A first step whose mean ratio is below 1 fails as one above it does (|ratio - 1|); the metrics are read
    whenever the step makes one update."""
    from grpo.checks import behaviour

    assert subject.cfg.grpo.num_iterations == 1
    for ratio in (0.9, 1.1):
        metrics = {"ratio/mean": ratio, "kl": 0.0, "clip_ratio/region_mean": 0.0}
        monkeypatch.setattr(behaviour, "grpo_step", lambda *args, m=metrics, **kwargs: SimpleNamespace(metrics=m))
        check = check_first_step(subject)
        assert check.status == "fail" and check.value == pytest.approx(0.1), ratio


def test_the_first_step_check_leaves_the_policy_and_the_optimizer_as_it_found_them(subject, monkeypatch):
    """Rewards that differ within each group, so the step's update moves the weights: the check undoes it."""
    from grpo.train import step as step_module

    monkeypatch.setattr(step_module, "group_rewards",
                        lambda texts, records, group, rewards: [float((-1) ** i) for i in range(len(texts))])
    before = [p.detach().clone() for p in subject.step.params]
    assert check_first_step(subject).status == "pass"
    assert all(torch.equal(a, b) for a, b in zip(before, subject.step.params, strict=True))
    assert not subject.step.optimizer.state
