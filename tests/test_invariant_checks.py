"""grpo/checks/invariants.py: each token-boundary check passes on the stage code and fails on the bug it is
about, planted in the stage function it drives, including where the bug hides from a lax comparison (the
loss on the prompt's last token only, the stop token dropped from the supervised ids alone, a wrong score on
the padded rows only)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.checks import invariants
from grpo.checks.gated import pad_not_stop
from grpo.model.sampling import CompletionPenalty
from grpo.train.step import header_tokens
from tests import gate_subjects

records, subject = gate_subjects.records, gate_subjects.subject  # the gate's fixtures, defined once


def _examples_changed(monkeypatch, change):
    """``sft.build_examples`` as the check calls it, each example passed through ``change(example, prompt_len)``."""
    build = invariants.build_examples

    def changed(records, tokenizer, max_length, template_kwargs):
        examples = build(records, tokenizer, max_length, template_kwargs)
        return [change(example, example.loss_mask.index(True)) for example in examples]  # index: the prompt's length

    monkeypatch.setattr(invariants, "build_examples", changed)


def test_render_parity_sees_loss_on_the_prompts_last_token(subject, monkeypatch):
    assert invariants.check_render_parity(subject).status == "pass"

    def loss_on_the_header(example, prompt_len):  # the assistant header's last token supervised
        mask = list(example.loss_mask)
        mask[prompt_len - 1] = True
        return example._replace(loss_mask=mask)

    _examples_changed(monkeypatch, loss_on_the_header)
    check = invariants.check_render_parity(subject)
    assert check.status == "fail" and check.value == len(subject.records) and "prompt tokens carry loss" in check.detail


def test_render_parity_reads_the_supervised_ids_not_the_ids(subject, monkeypatch):
    def stop_unsupervised(example, prompt_len):  # the ids still end with the stop token; the loss no longer sees it
        return example._replace(loss_mask=[*example.loss_mask[:-1], False])

    _examples_changed(monkeypatch, stop_unsupervised)
    check = invariants.check_render_parity(subject)
    assert check.status == "fail" and "do not end with a stop token (I2)" in check.detail


def test_render_parity_sees_sft_prompts_rendered_otherwise_than_the_rl_prompts(subject, monkeypatch):
    """I1: one token of each SFT prompt other than the sampler's (a template or system prompt of its own)."""
    def other_prompt(example, prompt_len):
        ids = list(example.ids)
        ids[prompt_len // 2] = ids[prompt_len // 2] + 1
        return example._replace(ids=ids)

    _examples_changed(monkeypatch, other_prompt)
    check = invariants.check_render_parity(subject)
    assert check.status == "fail" and check.value == len(subject.records)
    assert "the SFT prompt ids differ from the RL prompt ids (I1)" in check.detail


def test_left_padded_extraction_compares_every_row(subject, monkeypatch):
    """A scorer wrong on every row but the last (the longest prompt, the one without padding) is caught."""
    assert invariants.check_left_padded_extraction(subject).status == "pass"
    score = invariants.score_inputs

    def wrong_on_padded_rows(model, inputs, **kwargs):
        scored = score(model, inputs, **kwargs)
        logprobs = scored.logprobs.clone()
        logprobs[:-1] += 0.5
        return scored._replace(logprobs=logprobs)

    monkeypatch.setattr(invariants, "score_inputs", wrong_on_padded_rows)
    check = invariants.check_left_padded_extraction(subject)
    assert check.status == "fail" and check.value == pytest.approx(0.5, abs=1e-4)


def test_the_cut_and_mask_check_also_runs_with_a_pad_that_is_no_stop_token(subject):
    """The embedded tokenizer's pad is its end-of-turn token (as Llama-3's): the check adds a copy whose pad
    ends nothing, where a mask that reads ids instead of positions runs past the stop."""
    assert subject.tokenizer.pad_token_id in subject.eos_ids
    other = pad_not_stop(subject.tokenizer, subject.eos_ids)
    assert other is not None and other.pad_token_id not in subject.eos_ids
    assert pad_not_stop(other, subject.eos_ids) is None  # already no stop token: nothing to add
    check = invariants.check_rollout_cut_and_mask(subject)
    assert check.status == "pass" and "pad == a stop id" in check.detail and "pad != a stop id" in check.detail


def test_special_tokens_requires_the_tokenizers_eos_among_the_stop_ids(subject):
    assert invariants.check_special_tokens(subject).status == "pass"
    subject.step.eos_ids = [subject.tokenizer.convert_tokens_to_ids("<|end_of_text|>")]  # a stop id, not the eos
    assert subject.tokenizer.eos_token_id not in subject.eos_ids
    check = invariants.check_special_tokens(subject)
    assert check.status == "fail" and check.value == 1 and "must include the tokenizer's eos" in check.detail


def test_penalty_scope_passes_and_sees_penalties_that_count_the_prompt(subject, monkeypatch):
    """Processors built as if the prompt were completion (width 0) penalise every prompt word by at least
    presence + frequency = 2 and let EOS through at step 0: the check fails on the largest change."""
    assert invariants.check_penalty_scope(subject).status == "pass"
    build = invariants.build_logits_processors
    monkeypatch.setattr(invariants, "build_logits_processors", lambda width, eos_ids, cfg: build(0, eos_ids, cfg))
    check = invariants.check_penalty_scope(subject)
    assert check.status == "fail" and check.value >= 2.0


def test_left_padded_extraction_holds_every_row_to_the_log_prob_tolerance(subject, monkeypatch):
    """A scorer off by ten times the fp32 tolerance (1e-3 nats) on the padded rows fails: the bound is the
    tolerance itself, not a looser one."""
    score = invariants.score_inputs
    off = 10 * subject.tolerance()

    def slightly_wrong_on_padded_rows(model, inputs, **kwargs):
        scored = score(model, inputs, **kwargs)
        logprobs = scored.logprobs.clone()
        logprobs[:-1] += off
        return scored._replace(logprobs=logprobs)

    monkeypatch.setattr(invariants, "score_inputs", slightly_wrong_on_padded_rows)
    check = invariants.check_left_padded_extraction(subject)
    assert check.status == "fail" and check.value == pytest.approx(off, rel=5e-2)


def test_left_padded_extraction_sees_a_batch_of_re_tokenised_ids(subject, monkeypatch):
    """A ``prepare_batch`` that decodes the completions and encodes them again (I3) loses the stop token of
    the check's hand-made rows, which no decode/encode round trip keeps where pad is not a stop id (with pad ==
    the stop token, as the embedded tokenizer has, the round trip happens to give the same ids back)."""
    subject.step.tokenizer = pad_not_stop(subject.tokenizer, subject.eos_ids)
    assert invariants.check_left_padded_extraction(subject).status == "pass"
    prepare = invariants.prepare_batch

    def re_tokenising(step, drawn):
        rollout, width, pad = drawn.rollout, drawn.rollout.completion_ids.shape[1], step.tokenizer.pad_token_id
        ids = [(step.tokenizer.encode(text, add_special_tokens=False) + [pad] * width)[:width] for text in rollout.texts]
        rollout = dataclasses.replace(rollout, completion_ids=torch.tensor(ids))
        return prepare(step, dataclasses.replace(drawn, rollout=rollout))

    monkeypatch.setattr(invariants, "prepare_batch", re_tokenising)
    check = invariants.check_left_padded_extraction(subject)
    assert check.status == "fail" and "never re-tokenise" in check.detail


def _batch_changed(monkeypatch, change):
    """The check's ``step_batch``, its rollout and batch passed through ``change(batch, rollout, width)``."""
    original = invariants.step_batch

    def changed(s, seed, **grpo):
        batch, sampled = original(s, seed, **grpo)
        rollout = sampled.rollout
        batch, rollout = change(batch, rollout, rollout.prompt_ids.shape[1])
        return batch, dataclasses.replace(sampled, rollout=rollout)

    monkeypatch.setattr(invariants, "step_batch", changed)


def _with_ids(batch, ids):
    return dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, input_ids=ids))


def test_left_padded_extraction_names_ids_that_are_not_the_generated_ones(subject, monkeypatch):
    """I3 twice: the batch's completion ids other than the rollout's, and the rollout's other than what the
    decode loop returned; I4: a completion that starts with the tail of its own prompt."""
    def batch_other(batch, rollout, width):
        ids = batch.inputs.input_ids.clone()
        ids[0, width] += 1
        return _with_ids(batch, ids), rollout

    def rollout_other(batch, rollout, width):
        completion = rollout.completion_ids.clone()
        completion[0, 0] += 1
        return batch, dataclasses.replace(rollout, completion_ids=completion)

    def prompt_tail(batch, rollout, width):  # what a cut at row 0's own prompt width returns: its prompt's tail
        n = int(rollout.lengths[0])
        tail = rollout.prompt_ids[0, width - n :]
        completion, sequences, ids = (t.clone() for t in (rollout.completion_ids, rollout.sequences, batch.inputs.input_ids))
        completion[0, :n] = sequences[0, width : width + n] = ids[0, width : width + n] = tail
        return _with_ids(batch, ids), dataclasses.replace(rollout, completion_ids=completion, sequences=sequences)

    def drawn_other(batch, rollout, width):  # the sampler recorded drawing other ids than it returned
        assert rollout.sampler is not None, "the step's engine records its draws"
        ids = rollout.sampler.ids.clone()
        ids[0, 0] += 1
        return batch, dataclasses.replace(rollout, sampler=rollout.sampler._replace(ids=ids))

    def prompt_other(batch, rollout, width):
        ids = batch.inputs.input_ids.clone()
        ids[0, width - 1] += 1
        return _with_ids(batch, ids), rollout

    def header_inside(batch, rollout, width):
        header = subject.tokenizer.convert_tokens_to_ids(header_tokens(subject.tokenizer, subject.eos_ids))[0]
        completion = rollout.completion_ids.clone()
        completion[0, 0] = header
        return batch, dataclasses.replace(rollout, completion_ids=completion)

    for change, message in ((batch_other, "prepare_batch's completion ids are not the generated ids (I3)"),
                            (rollout_other, "are not the ids the decode loop generated and drew (I3)"),
                            (drawn_other, "are not the ids the decode loop generated and drew (I3)"),
                            (prompt_other, "row 0: the prompt ids are not the rendered prompt"),
                            (header_inside, "row 0: a chat-header token in the completion"),
                            (prompt_tail, "row 0: the completion starts with the last")):
        with monkeypatch.context() as patch:
            _batch_changed(patch, change)
            check = invariants.check_left_padded_extraction(subject)
        assert check.status == "fail" and message in check.detail, (change.__name__, check.detail)


def _rollouts_changed(monkeypatch, change):
    """``rollout_from_sequences`` as the cut-and-mask check calls it, its rollout passed through
    ``change(rollout, tokenizer, prompt, sequences, eos_ids)``."""
    original = invariants.rollout_from_sequences

    def changed(tokenizer, prompt, sequences, eos_ids, *args, **kwargs):
        rollout = original(tokenizer, prompt, sequences, eos_ids, *args, **kwargs)
        return change(rollout, tokenizer, prompt, sequences, eos_ids)

    monkeypatch.setattr(invariants, "rollout_from_sequences", changed)


def test_the_cut_and_mask_check_fails_a_cut_at_each_rows_own_prompt_length(subject, monkeypatch):
    """A per-row cut (each row at the length of its unpadded prompt) returns the prompt's tail on every padded
    row: the probe's prompts are of different widths, so it shows."""
    def per_row_cut(rollout, tokenizer, prompt, sequences, eos_ids):
        width = rollout.completion_ids.shape[1]
        starts = prompt.attention_mask.sum(-1).tolist()
        ids = torch.stack([sequences[i, start : start + width] for i, start in enumerate(starts)])
        return dataclasses.replace(rollout, completion_ids=ids)

    _rollouts_changed(monkeypatch, per_row_cut)
    check = invariants.check_rollout_cut_and_mask(subject)
    assert check.status == "fail" and "rows cut wrong: ['pad == a stop id row 0'" in check.detail, check.detail


def test_the_cut_and_mask_check_fails_a_mask_that_drops_a_sampled_pad_that_is_no_stop(subject, monkeypatch):
    """``mask & (ids != pad or a stop)``: right wherever pad is a stop id, wrong on a pad token sampled mid-row
    where it is not. The pad-that-is-no-stop copy puts one such row in the probe, and the check sees it."""
    def pads_dropped(rollout, tokenizer, prompt, sequences, eos_ids):
        ids = rollout.completion_ids
        keep = (ids != tokenizer.pad_token_id) | torch.isin(ids, torch.tensor(eos_ids))
        return dataclasses.replace(rollout, completion_mask=rollout.completion_mask & keep)

    _rollouts_changed(monkeypatch, pads_dropped)
    check = invariants.check_rollout_cut_and_mask(subject)
    assert check.status == "fail" and check.value == 1, check.detail
    assert "rows masked wrong: ['pad != a stop id row 3']" in check.detail


def test_the_cut_and_mask_check_fails_one_wrong_row_of_ids_or_of_mask(subject, monkeypatch):
    """The bound is 0 rows: one row cut wrong, or one row masked one token past its stop, fails alone."""
    def one_id(rollout, tokenizer, prompt, sequences, eos_ids):
        if tokenizer.pad_token_id not in eos_ids:
            return rollout
        ids = rollout.completion_ids.clone()
        ids[2, -1] += 1
        return dataclasses.replace(rollout, completion_ids=ids)

    def one_past_the_stop(rollout, tokenizer, prompt, sequences, eos_ids):
        if tokenizer.pad_token_id not in eos_ids:
            return rollout
        mask = rollout.completion_mask.clone()
        mask[0, int(mask[0].sum())] = True
        return dataclasses.replace(rollout, completion_mask=mask)

    for change, wrong in ((one_id, "rows cut wrong: ['pad == a stop id row 2']"),
                          (one_past_the_stop, "rows masked wrong: ['pad == a stop id row 0']")):
        with monkeypatch.context() as patch:
            _rollouts_changed(patch, change)
            check = invariants.check_rollout_cut_and_mask(subject)
        assert check.status == "fail" and check.value == 1 and check.bound == 0 and wrong in check.detail, change


def test_penalty_scope_states_a_bound_of_zero_and_fails_a_presence_penalty_that_counts_the_prompt(subject,
                                                                                                  monkeypatch):
    """The presence penalty alone counting the prompt (the frequency penalty right) moves each prompt word by
    exactly the presence penalty, 1: a bound of 0 logits sees it."""
    check = invariants.check_penalty_scope(subject)
    assert check.status == "pass" and check.value == 0.0 and check.bound == 0.0
    build = invariants.build_logits_processors

    def presence_over_the_prompt(width, eos_ids, cfg):
        processors, suppressor = build(width, eos_ids, cfg)
        processors[0] = CompletionPenalty(0, cfg.presence_penalty, 0.0)
        processors.insert(1, CompletionPenalty(width, 0.0, cfg.frequency_penalty))
        return processors, suppressor

    monkeypatch.setattr(invariants, "build_logits_processors", presence_over_the_prompt)
    check = invariants.check_penalty_scope(subject)
    assert check.status == "fail" and check.value == 1.0


def test_penalty_scope_fails_eos_suppression_of_one_stop_id_of_several(subject, monkeypatch):
    """Every stop id must be suppressed at step 0 (Llama-3 stops on several): a suppressor given only the first
    lets the others through."""
    subject.step.eos_ids = [subject.tokenizer.eos_token_id, subject.tokenizer.convert_tokens_to_ids("<|end_of_text|>")]
    assert len(set(subject.eos_ids)) == 2
    assert invariants.check_penalty_scope(subject).status == "pass"
    build = invariants.build_logits_processors
    monkeypatch.setattr(invariants, "build_logits_processors", lambda width, eos_ids, cfg: build(width, eos_ids[:1], cfg))
    check = invariants.check_penalty_scope(subject)
    assert check.status == "fail" and "EOS was not suppressed at step 0" in check.detail


def test_penalty_scope_probes_eos_suppression_when_the_config_asks_for_none(subject, monkeypatch):
    """With ``min_new_tokens: 0`` configured the check still turns suppression on (at least one token), so a
    suppressor that counts the prompt shows."""
    cfg = subject.cfg.model_copy(update={"grpo": subject.cfg.grpo.model_copy(update={
        "sampling": subject.cfg.grpo.sampling.model_copy(update={"min_new_tokens": 0})})})
    s = SimpleNamespace(cfg=cfg, prompts=subject.prompts, eos_ids=subject.eos_ids, tokenizer=subject.tokenizer)
    assert invariants.check_penalty_scope(s).status == "pass"
    build = invariants.build_logits_processors
    monkeypatch.setattr(invariants, "build_logits_processors", lambda width, eos_ids, cfg: build(0, eos_ids, cfg))
    assert "EOS was not suppressed at step 0" in invariants.check_penalty_scope(s).detail


def test_render_parity_fails_one_record_alone(subject, monkeypatch):
    """The bound is 0 problems: loss on the prompt of one record only fails."""
    first = []

    def loss_on_the_first_prompt(example, prompt_len):
        first.append(example)
        if len(first) > 1:
            return example
        mask = list(example.loss_mask)
        mask[prompt_len - 1] = True
        return example._replace(loss_mask=mask)

    _examples_changed(monkeypatch, loss_on_the_first_prompt)
    check = invariants.check_render_parity(subject)
    assert check.status == "fail" and check.value == 1 and check.bound == 0


def test_left_padded_extraction_fails_a_gap_at_one_token_of_a_padded_row(subject, monkeypatch):
    """A scorer wrong at the first completion token of the padded rows only (a position off by one there): the
    gap is the largest over a row's tokens, not a typical one."""
    score = invariants.score_inputs

    def wrong_at_the_first_token(model, inputs, **kwargs):
        scored = score(model, inputs, **kwargs)
        logprobs = scored.logprobs.clone()
        logprobs[:-1, 0] += 0.5
        return scored._replace(logprobs=logprobs)

    monkeypatch.setattr(invariants, "score_inputs", wrong_at_the_first_token)
    check = invariants.check_left_padded_extraction(subject)
    assert check.status == "fail" and check.value == pytest.approx(0.5, abs=1e-4)
