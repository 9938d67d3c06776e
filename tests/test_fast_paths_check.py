"""grpo/checks/fast_paths.py: the gate holds every fast path in use to the library's path, on the tiny model.

| broken on purpose | what the check says |
| --- | --- |
| the kept prefill's rows mapped to the prompts by the permutation, not its inverse | step rollout rows differ |
| evaluation's samples started from the greedy pass's last columns instead of its first | evaluation's samples differ |
| the decode writes another id than the one it drew | recorded draws differ, and the rollout |
| ``generate`` samples at T squared (invisible at T = 1: the probes sample at 0.7) | step rollout rows differ |
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.checks import fast_paths
from grpo.checks.fast_paths import check_fast_paths, interleaved
from grpo.config import config_from_dict
from grpo.model import generation
from grpo.model.fast import decode as loop
from grpo.model.fast import prompt_pass as prompt_pass_module
from tests.gate_subjects import CFG, subject_for
from tests.steps import decode_cache_by_the_permutation, step_records
from tests.weights import spread_weights


def _subject(tiny_model, tiny_tokenizer, cfg=CFG):
    """The gate's view of the tiny model (the project's attention kernel, whose passes the prompt pass watches)
    with weights that make completions vary and stop at different places."""
    spread_weights(tiny_model, torch.Generator().manual_seed(0))
    return subject_for(cfg, tiny_model, tiny_tokenizer, step_records())


def test_the_fast_paths_give_the_library_paths_tokens(tiny_model, tiny_tokenizer, monkeypatch):
    """A real comparison: the kept prefill, the decode loop and evaluation's reused greedy pass all run."""
    reused = []
    original = prompt_pass_module.PromptPass.prefilled

    def spied(self, *args):
        cache = original(self, *args)
        reused.append(cache is not None)
        return cache

    monkeypatch.setattr(prompt_pass_module.PromptPass, "prefilled", spied)
    subject = _subject(tiny_model, tiny_tokenizer)
    assert subject.step.reuses_prefill
    check = check_fast_paths(subject)
    assert check.status == "pass", check.detail
    assert reused and all(reused), "evaluation's samples started from the greedy pass"


def test_interleaved_probes_order_the_kept_prefill_by_a_permutation_that_is_not_its_own_inverse():
    records = step_records()
    tasks = [r["task"] for r in interleaved(records)]
    assert tasks[0] == tasks[3] != tasks[1] == tasks[2]


def test_a_kept_prefill_mapped_to_other_prompts_fails(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("grpo.model.rollout.decode_cache", decode_cache_by_the_permutation)
    check = check_fast_paths(_subject(tiny_model, tiny_tokenizer))
    assert check.status == "fail" and "step rollout rows unlike generate's" in check.detail, check.detail


def test_evaluation_samples_from_a_shifted_greedy_pass_fail(tiny_model, tiny_tokenizer, monkeypatch):
    original = prompt_pass_module.PromptPass.prefilled

    def shifted(self, model, prompt_ids, prompt_mask, repeats):
        cache = original(self, model, prompt_ids, prompt_mask, repeats)
        if cache is None:
            return None
        shifted_layers = [(k[..., 1:, :], v[..., 1:, :]) for k, v in self.layers]  # the last columns, not the first
        cache = self.cache_class(shifted_layers, config=model.config)
        cache.batch_repeat_interleave(repeats)
        return cache

    monkeypatch.setattr(prompt_pass_module.PromptPass, "prefilled", shifted)
    check = check_fast_paths(_subject(tiny_model, tiny_tokenizer))
    assert check.status == "fail" and "evaluation's samples unlike the library's" in check.detail, check.detail


def test_a_decode_that_writes_another_id_than_it_drew_fails(tiny_model, tiny_tokenizer, monkeypatch):
    # The loop's self-check (memoised per process) runs ``decode`` too: taken before the patch, so that the
    # loop stays in use here and no later test inherits a fallback this patch caused, in any test order.
    assert loop.loop_mismatch() is None
    original = loop.decode

    def forced(*args, **kwargs):
        sequences = original(*args, **kwargs).clone()
        sequences[0, -1] = 300
        return sequences

    monkeypatch.setattr(loop, "decode", forced)
    check = check_fast_paths(_subject(tiny_model, tiny_tokenizer))
    assert check.status == "fail" and "recorded draws are not their ids" in check.detail, check.detail


def test_a_mask_that_does_not_end_at_the_drawn_stop_fails(tiny_model, tiny_tokenizer):
    """``_recorded`` holds the mask to the stop token the loop drew, not only the ids to the draws."""
    subject = _subject(tiny_model, tiny_tokenizer)
    fast, _ = fast_paths._step_rollouts(subject, interleaved(subject.records))
    assert fast_paths._recorded(fast, subject.eos_ids) == []
    mask = fast.completion_mask.clone()
    mask[1, int(fast.lengths[1]) - 1] = False  # the mask ends a token before the stop the loop drew
    assert fast_paths._recorded(dataclasses.replace(fast, completion_mask=mask), subject.eos_ids) == [1]


def test_a_rollout_without_its_record_or_its_entropies_fails_every_row(tiny_model, tiny_tokenizer):
    """Nothing to compare is no agreement: a rollout with no sampler record (the run-time agreement, I10, would
    have nothing either) or no sample entropies fails every row."""
    subject = _subject(tiny_model, tiny_tokenizer)
    fast, plain = fast_paths._step_rollouts(subject, interleaved(subject.records))
    rows = list(range(len(fast.texts)))
    assert fast_paths._recorded(dataclasses.replace(fast, sampler=None), subject.eos_ids) == rows
    with_entropy = dataclasses.replace(fast, entropy=torch.zeros(fast.completion_ids.shape))
    assert fast_paths._entropy_differs(with_entropy, with_entropy) == []
    assert fast_paths._entropy_differs(dataclasses.replace(fast, entropy=None), with_entropy) == rows
    nan = dataclasses.replace(fast, entropy=torch.full(fast.completion_ids.shape, float("nan")))
    assert fast_paths._entropy_differs(nan, with_entropy) == rows  # a NaN entropy is no agreement


def test_sample_entropies_off_the_librarys_fail_on_the_same_tokens(tiny_model, tiny_tokenizer, monkeypatch):
    """A wrong cache may draw the very tokens from other logits: the entropies of equal samples are compared."""
    evaluation = fast_paths._evaluation

    def drifted(s, records, fast):
        greedy, sampled = evaluation(s, records, fast)
        if fast.setting == "off":
            return greedy, sampled
        return greedy, dataclasses.replace(sampled, entropy=sampled.entropy + 10 * fast_paths.ENTROPY_BOUND)

    monkeypatch.setattr(fast_paths, "_evaluation", drifted)
    check = check_fast_paths(_subject(tiny_model, tiny_tokenizer))
    assert check.status == "fail" and "sample entropies off the library's" in check.detail, check.detail
    assert "evaluation's samples unlike the library's" not in check.detail


def test_generate_at_the_squared_temperature_fails(tiny_model, tiny_tokenizer, monkeypatch):
    """The library's path samples at T squared: at the configured T = 1 nothing would show, so the probes
    sample at ``PROBE_TEMPERATURE``, where the two paths' tokens part."""
    original = generation.generation_config

    def squared(sampling, *args, **kwargs):
        return original(sampling.model_copy(update={"temperature": sampling.temperature**2}), *args, **kwargs)

    monkeypatch.setattr(generation, "generation_config", squared)
    subject = _subject(tiny_model, tiny_tokenizer)
    assert subject.cfg.grpo.sampling.temperature == 1.0
    check = check_fast_paths(subject)
    assert check.status == "fail" and "step rollout rows unlike generate's" in check.detail, check.detail


@pytest.mark.parametrize("setting", ["off"])
def test_off_has_nothing_to_compare(tiny_model, tiny_tokenizer, setting):
    cfg = config_from_dict({**CFG.model_dump(mode="json"),
                            "model": {**CFG.model.model_dump(mode="json"), "fast_paths": setting}})
    check = check_fast_paths(_subject(tiny_model, tiny_tokenizer, cfg))
    assert check.status == "pass" and "off" in check.detail
