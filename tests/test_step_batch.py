"""grpo/train/step.py: the batch a draw makes for the update (``prepare_batch``): the stored old and
reference log-probs, their temperature, and the rollout's prefill kept for the update."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.train.step import build_step, draw, grpo_step, prepare_batch
from tests.steps import make_step, step_records


@pytest.fixture(scope="module")
def records():
    return step_records()


def test_i9_reference_is_the_sft_policy_with_the_adapter_disabled(tiny_model, tiny_tokenizer, records):
    """The KL reference is the SFT weights themselves (the LoRA adapter switched off), not the
    pre-SFT base and not the moving policy; no second copy of the weights is made."""
    from grpo.core.logprobs import score_completions

    sft = copy.deepcopy(tiny_model)
    step = make_step(tiny_model, tiny_tokenizer, loss={"beta": 0.1})
    with torch.no_grad():  # a trained adapter: the policy now differs from the SFT model
        for name, param in step.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    batch = prepare_batch(step, draw(step, records, seed=2))
    width = batch.completion_mask.shape[1]
    with torch.no_grad():
        inputs = batch.inputs
        expected = score_completions(sft, inputs.input_ids, inputs.attention_mask, width, 1.0).logprobs
        policy = score_completions(step.model, inputs.input_ids, inputs.attention_mask, width, 1.0).logprobs
    mask = batch.completion_mask
    torch.testing.assert_close(batch.ref_logprobs[mask], expected[mask], rtol=0, atol=1e-5)
    assert (policy[mask] - expected[mask]).abs().max() > 1e-3, "the adapter did not change the policy"
    assert sum(p.numel() for p in step.model.parameters()) < 2 * sum(p.numel() for p in sft.parameters())


def test_i10_scoring_takes_the_temperature_the_rollout_sampled_at(tiny_model, tiny_tokenizer, records):
    """The rollout records its temperature; the stored old and reference log-probs use it even when
    the config is changed afterwards (no scorer reads grpo.sampling.temperature)."""
    from grpo.core.logprobs import score_completions

    step = make_step(tiny_model, tiny_tokenizer, num_iterations=2, loss={"beta": 0.1},
                       sampling={"max_new_tokens": 5, "temperature": 0.7, "top_k": 5})
    sampled = draw(step, records, seed=4)
    assert sampled.rollout.temperature == 0.7 and sampled.rollout.processors == ("top_k=5", "min_new_tokens=1")
    grpo = step.cfg.grpo  # a later change of the config must not reach the scoring of this rollout
    sampling = grpo.sampling.model_copy(update={"temperature": 1.0})
    step.cfg = step.cfg.model_copy(update={"grpo": grpo.model_copy(update={"sampling": sampling})})
    batch = prepare_batch(step, sampled)
    inputs, mask = batch.inputs, batch.completion_mask
    assert inputs.temperature == 0.7
    with torch.no_grad():
        at_07 = score_completions(step.model, inputs.input_ids, inputs.attention_mask, mask.shape[1], 0.7).logprobs
    torch.testing.assert_close(batch.old_logprobs[mask], at_07[mask], rtol=0, atol=1e-6)


def test_num_iterations_old_and_new_logprobs_are_the_same_distribution(tiny_model, tiny_tokenizer, records):
    """With num_iterations > 1 the stored old log-probs come from the same scoring path, temperature
    and precision as the update's: before the first optimizer step the ratio is exactly 1."""
    from grpo.train.update import global_totals, task_losses

    step = make_step(tiny_model, tiny_tokenizer, num_iterations=2, sampling={"max_new_tokens": 5, "temperature": 0.6})
    batch = prepare_batch(step, draw(step, records, seed=6))
    _, stats, _ = task_losses(step, batch, global_totals(step, batch), tuple(batch.rows), 0)
    for task, task_stats in stats.items():
        assert task_stats["ratio/mean"] == pytest.approx(1.0, abs=1e-6), task
        assert task_stats["clip_ratio/region_mean"] == 0.0, task


@pytest.mark.parametrize(("grpo", "kept"), [
    ({}, True),
    ({"reuse_prefill": False}, False),
    ({"shared_prefix": False}, False),
    ({"num_iterations": 2}, False),  # the second optimizer step would score with moved weights
    ({"grad_accum": 2}, False),  # each micro-batch's backward would run through the same prompt graph
    ({"dynamic_sampling": "filter"}, False),  # the selected groups are a new rollout: the graph would be waste
], ids=["default", "off", "no-shared-prefix", "two-iterations", "two-micro-batches", "dynamic-sampling"])
def test_the_rollouts_prefill_is_kept_only_where_the_update_would_repeat_it(tiny_model, tiny_tokenizer, records,
                                                                             grpo, kept):
    step = make_step(tiny_model, tiny_tokenizer, **grpo)
    assert step.reuses_prefill is kept
    assert bool(draw(step, records, seed=3).prefills) is kept
    grpo_step(step, records, 1, lambda attempt: records)  # and the step runs either way


def test_no_prefill_is_kept_for_a_model_with_dropout(tiny_model, tiny_tokenizer):
    """The rollout runs in eval mode, the update in train mode: with dropout they are not the same pass."""
    step = make_step(tiny_model, tiny_tokenizer)
    assert step.reuses_prefill
    layer = next(m for m in step.model.modules() if hasattr(m, "lora_dropout"))
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1)  # what model.lora.dropout: 0.1 builds
    rebuilt = build_step(step.cfg, step.policy, step.accelerator)
    assert not rebuilt.reuses_prefill


def test_i10_the_reference_is_scored_at_the_rollouts_temperature(tiny_model, tiny_tokenizer, records):
    """The stored reference log-probs at T = 0.7 are those of the SFT weights (a copy without the adapter)
    under softmax(z / 0.7), scored row by row apart."""
    sft = copy.deepcopy(tiny_model)
    step = make_step(tiny_model, tiny_tokenizer, loss={"beta": 0.04}, sampling={"max_new_tokens": 5, "temperature": 0.7})
    with torch.no_grad():  # a moved adapter: the reference is the SFT weights, not the policy
        for name, param in step.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
    batch = prepare_batch(step, draw(step, records, seed=9))
    inputs, mask = batch.inputs, batch.completion_mask
    from grpo.core.logprobs import score_completions

    with torch.no_grad():
        want = score_completions(sft, inputs.input_ids, inputs.attention_mask, mask.shape[1], 0.7).logprobs
    torch.testing.assert_close(batch.ref_logprobs[mask], want[mask], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fast_paths", ["auto", "off"])
def test_the_step_prefills_by_task_whether_or_not_it_keeps_the_prefill(tiny_model, tiny_tokenizer, fast_paths):
    """``draw`` asks its engine for one prefill pass per task in both settings, and for the graph only where
    the update reuses it: ``off`` runs the very prompt passes ``auto`` keeps (``rollout.sample_rollout``), so
    keeping them changes no sampled token under bf16 either."""
    step = make_step(tiny_model, tiny_tokenizer, fast_paths=fast_paths)
    asked = []
    generate = step.engine.generate
    step.engine.generate = lambda *args, **kwargs: asked.append(kwargs) or generate(*args, **kwargs)
    records = step_records()
    draw(step, records, seed=1)
    assert step.reuses_prefill == (fast_paths == "auto")
    assert asked == [{"segments": [r["task"] for r in records], "keep_prefill": step.reuses_prefill}]


@pytest.mark.parametrize(("num_iterations", "beta"), [(1, 0.0), (1, 0.04), (2, 0.0), (2, 0.04)])
def test_the_batch_stores_old_logprobs_only_for_several_iterations_and_the_reference_only_with_a_kl(
        tiny_model, tiny_tokenizer, records, num_iterations, beta):
    """``prepare_batch``: each task's rows are exactly the rows of its task; the old log-probs are scored
    only where the update takes more than one optimizer step on the batch, the reference's only where the
    loss has a KL term, each over every completion position."""
    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, num_iterations=num_iterations, loss={"beta": beta})
    sampled = draw(step, records, seed=4)
    batch = prepare_batch(step, sampled)
    assert set(batch.rows) == {"fairness", "hallucination"}
    for task, rows in batch.rows.items():
        assert rows.tolist() == [i for i, t in enumerate(sampled.tasks) if t == task]
    assert (batch.old_logprobs is not None) == (num_iterations > 1)
    assert (batch.ref_logprobs is not None) == (beta > 0)
    for stored in (batch.old_logprobs, batch.ref_logprobs):
        if stored is not None:
            assert stored.shape == batch.inputs.completion_mask.shape
            assert bool((stored[batch.inputs.completion_mask.bool()] < 0).all())
