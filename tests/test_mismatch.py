"""grpo/train/mismatch.py through the GRPO step: rollouts from another engine are measured against
the trainer's scoring and their policy term is reweighted by truncated importance sampling."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from grpo.config import config_from_dict
from grpo.data.prepare import build_records
from grpo.model.engine_types import EngineRollout
from grpo.model.engines import HFEngine
from grpo.model.fast import FastPaths
from grpo.model.precision import bf16_autocast, cpu_has_native_bf16
from grpo.train.mismatch import trainer_logprobs
from grpo.train.step import build_step, draw, prepare_batch
from tests.steps import combined_gradient, make_step


@pytest.fixture(scope="module")
def one_per_task() -> list[dict]:
    train = [r.model_dump(mode="json") for r in build_records(config_from_dict({"data": {"n_train": 8}}))["train"]]
    return [next(r for r in train if r["task"] == task) for task in ("fairness", "hallucination")]


class ShiftedEngine:
    """The HF engine, but it reports sampler log-probs ``log(shift)`` below the trainer's: every
    sampled token looks ``shift`` times likelier to the trainer than to the sampler."""

    name = "shifted"

    def __init__(self, model, tokenizer, shift: float) -> None:
        self.hf, self.shift = HFEngine(model, tokenizer, fast=FastPaths()), shift

    def generate(self, prompts, group_size, sampling, eos_ids, seed, **prefill) -> EngineRollout:
        rollout = self.hf.generate(prompts, group_size, sampling, eos_ids, seed, **prefill).rollout
        trainer = trainer_logprobs(self.hf.model, rollout)
        return EngineRollout(rollout, (trainer - math.log(self.shift)) * rollout.completion_mask)

    def sync_weights(self, model) -> None:
        pass


def with_engine(step, engine):
    """The step built again around another engine (the facts it decides, such as the kept prefill, follow)."""
    return build_step(step.cfg, step.policy, step.accelerator, engine=engine)


def _gradient(tiny_model, tiny_tokenizer, one_per_task, shift: float | None, **rollout) -> tuple[torch.Tensor, dict]:
    """The combined gradient of one step (sum mode, policy term only) and the draw's stats."""
    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "sum"},
                       loss={"beta": 0.0}, rollout=rollout)
    if shift is not None:
        step = with_engine(step, ShiftedEngine(step.model, tiny_tokenizer, shift))
    sampled = draw(step, one_per_task, seed=11)
    signal = dataclasses.replace(sampled, advantages=torch.linspace(-1, 1, len(sampled.rewards)))
    return combined_gradient(step, prepare_batch(step, signal)), sampled.stats


@pytest.mark.parametrize("shift, cap, factor", [(1.5, 2.0, 1.5), (3.0, 2.0, 2.0)])
def test_policy_gradient_is_reweighted_and_truncated(tiny_model, tiny_tokenizer, one_per_task, shift, cap, factor):
    """Weights min(p_trainer / p_sampler, cap) = min(shift, cap) on every token scale the gradient."""
    plain, plain_stats = _gradient(tiny_model, tiny_tokenizer, one_per_task, None)
    weighted, stats = _gradient(tiny_model, tiny_tokenizer, one_per_task, shift, tis_cap=cap)
    assert plain.abs().max() > 0 and "sampling/kl" not in plain_stats
    torch.testing.assert_close(weighted, factor * plain, rtol=1e-4, atol=1e-7)
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(math.log(shift), abs=1e-5)
    assert stats["sampling/importance_sampling_weight/mean"] == pytest.approx(factor, abs=1e-5)


def test_mismatch_under_the_threshold_leaves_the_gradient_alone(tiny_model, tiny_tokenizer, one_per_task):
    plain, _ = _gradient(tiny_model, tiny_tokenizer, one_per_task, None)
    small, stats = _gradient(tiny_model, tiny_tokenizer, one_per_task, 1.01, tis_threshold=0.05)
    torch.testing.assert_close(small, plain, rtol=1e-5, atol=1e-8)
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(math.log(1.01), abs=1e-5)


class SameScoringEngine(ShiftedEngine):
    """The HF engine reporting, as the sampler's, the trainer's log-probs under bf16 autocast: exactly
    what the step's loss scores with ``grpo.bf16``, so the step must measure no mismatch at all."""

    def generate(self, prompts, group_size, sampling, eos_ids, seed, **prefill) -> EngineRollout:
        rollout = self.hf.generate(prompts, group_size, sampling, eos_ids, seed, **prefill).rollout
        with bf16_autocast(torch.device("cpu"), bf16=True):
            trainer = trainer_logprobs(self.hf.model, rollout)
        return EngineRollout(rollout, trainer * rollout.completion_mask)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16: grpo.bf16 runs fp32 here")
def test_the_mismatch_is_measured_in_the_steps_precision(tiny_model, tiny_tokenizer, one_per_task):
    """Under ``grpo.bf16`` the trainer's side of the importance weights is scored under the same autocast
    as the loss: a sampler that agrees with that scoring gives weights of exactly 1 (fp32 scoring of
    bf16-trained log-probs would read a mismatch of about 1e-3 that no engine caused)."""
    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, bf16=True, rollout={"tis_threshold": 0.0})
    step = with_engine(step, SameScoringEngine(step.model, tiny_tokenizer, 1.0))
    sampled = draw(step, one_per_task, seed=11)
    assert sampled.stats["sampling/sampling_logp_difference/max"] == 0.0
    mask = sampled.rollout.completion_mask
    assert torch.equal(sampled.is_weights[mask], torch.ones(int(mask.sum())))


def _rollout(step, one_per_task):
    from grpo.data.prompts import render_records

    prompts = render_records(step.tokenizer, one_per_task, step.cfg.model.chat_template_kwargs)
    return step.engine.generate(prompts, 2, step.cfg.grpo.sampling, step.eos_ids, 3).rollout


def test_the_logged_weight_mean_is_over_the_completion_tokens(tiny_model, tiny_tokenizer, one_per_task):
    """Rows that stop early leave padding: weights of 1.5 on every sampled token have a mean of 1.5."""
    from grpo.config import RolloutConfig
    from grpo.train.mismatch import sampler_correction

    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
    rollout = _rollout(step, one_per_task)
    mask = rollout.completion_mask.clone()
    mask[0, 2:] = False  # the first row stopped after two tokens
    rollout = dataclasses.replace(rollout, completion_mask=mask)
    sampler = (trainer_logprobs(step.model, rollout) - math.log(1.5)) * mask
    stats, weights = sampler_correction(step.model, rollout, sampler, RolloutConfig(tis_cap=2.0, tis_threshold=0.0))
    assert not mask.all() and stats["sampling/importance_sampling_weight/mean"] == pytest.approx(1.5, abs=1e-5)


def test_the_trainers_side_is_the_policy_with_its_adapter(tiny_model, tiny_tokenizer, one_per_task):
    """Once the adapter has moved, the trainer's log-probs are the policy's, not the reference's (adapter off)."""
    from grpo.model.scoring import rollout_inputs, score_inputs

    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
    with torch.no_grad():
        for name, param in step.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    rollout = _rollout(step, one_per_task)
    inputs = rollout_inputs(rollout, torch.device("cpu"))
    with torch.no_grad():
        policy, reference = (score_inputs(step.model, inputs, adapter=on).logprobs for on in (True, False))
    assert (policy - reference).abs().max() > 1e-3  # the adapter moved the policy
    torch.testing.assert_close(trainer_logprobs(step.model, rollout), policy, rtol=0, atol=1e-6)
