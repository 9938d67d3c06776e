"""grpo/train/update.py: the step's update, scored part by part; I7 (a step on the entropy bonus raises
entropy) in every gradient mode, through the very function the trainer runs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from grpo.core.losses import masked_mean
from grpo.core.multitask import MultitaskError
from grpo.model.scoring import score_inputs
from grpo.train.step import draw, prepare_batch
from grpo.train.update import Totals, _share, global_totals, gradient, parts, task_losses, token_means, update
from tests.steps import make_step, step_records, with_advantages


@pytest.fixture(scope="module")
def records():
    return step_records()


MODES = [  # (mode, reward_only, low_memory, task_stats)
    ("sum", False, False, True), ("pcgrad", False, False, False), ("cagrad", False, False, False),
    ("cagrad", True, False, False), ("cagrad", False, True, False), ("pcgrad", True, False, False),
    ("sum", False, True, True), ("cagrad", True, True, False), ("sum", False, True, False),
    ("sum", True, True, False),
]


def _batch(step, records, advantages=None):
    sampled = draw(step, records, seed=5)
    advantages = torch.zeros(len(sampled.rewards)) if advantages is None else advantages
    return prepare_batch(step, with_advantages(sampled, advantages))


@torch.no_grad()
def _entropy(step, batch) -> float:
    return float(masked_mean(score_inputs(step.model, batch.inputs).entropy, batch.completion_mask))


@pytest.mark.parametrize(("mode", "reward_only", "low_memory", "task_stats"), MODES)
@pytest.mark.parametrize("entropy_coef", [0.5, -0.5])
def test_i7_entropy_step_raises_entropy_in_every_mode(tiny_model, tiny_tokenizer, records, mode, reward_only,
                                                      low_memory, task_stats, entropy_coef):
    """Zero advantages and no KL: the update's direction is the entropy bonus's alone, combined in the mode;
    one SGD step along it raises entropy for a positive coefficient and lowers it for a negative one."""
    multitask = {"mode": mode, "reward_only": reward_only, "low_memory": low_memory, "task_stats": task_stats}
    step = make_step(tiny_model, tiny_tokenizer, multitask=multitask,
                       loss={"beta": 0.0, "entropy_coef": entropy_coef})
    with torch.no_grad():  # a moved adapter, so the entropy gradient reaches A and B
        for name, param in step.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    batch = _batch(step, records)
    before = _entropy(step, batch)
    direction = gradient(step, batch, global_totals(step, batch)).direction
    with torch.no_grad():
        offset = 0
        for p in step.params:
            p -= 2.0 * direction[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    after = _entropy(step, batch)
    assert (after - before) * entropy_coef > 1e-5, (before, after)


def test_parts_score_per_task_or_together(tiny_model, tiny_tokenizer):
    tasks = ("fairness", "hallucination")
    low = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "cagrad"}, grad_accum=2)
    assert parts(low) == [(("fairness",), 0), (("hallucination",), 0), (("fairness",), 1), (("hallucination",), 1)]
    shared = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "cagrad", "low_memory": False})
    assert parts(shared) == [(tasks, 0)]
    summed = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "sum"})
    assert summed.summed and parts(summed) == [(tasks, 0)]


def test_the_summed_backward_is_the_sum_of_the_task_gradients(tiny_model, tiny_tokenizer, records):
    """``sum`` without task statistics takes one backward of the summed loss: the same direction as the
    per-task gradients summed, without their norms."""
    advantages = torch.linspace(-1, 1, 2 * len(records))
    loss = {"beta": 0.04, "entropy_coef": 0.01}
    one = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "sum"}, loss=loss)
    each = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "sum", "task_stats": True},
                        loss=loss)
    got, got_stats, _, _ = gradient(one, b := _batch(one, records, advantages), global_totals(one, b))
    want, want_stats, _, _ = gradient(each, c := _batch(each, records, advantages), global_totals(each, c))
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert "grad_norm/fairness" not in got_stats and "grad_norm/fairness" in want_stats
    assert got_stats["loss/fairness"] == pytest.approx(want_stats["loss/fairness"], abs=1e-6)


@pytest.mark.parametrize("multitask", [{"mode": "sum"}, {"mode": "cagrad"}, {"mode": "cagrad", "low_memory": False}])
def test_a_nan_loss_raises_naming_the_task_and_updates_nothing(tiny_model, tiny_tokenizer, records, multitask):
    step = make_step(tiny_model, tiny_tokenizer, multitask=multitask)
    advantages = torch.ones(2 * len(records))
    batch = _batch(step, records, advantages)
    advantages[batch.rows["hallucination"][0]] = float("nan")
    batch = _batch(step, records, advantages)
    before = [p.detach().clone() for p in step.model.parameters()]
    with pytest.raises(MultitaskError, match="hallucination"):
        update(step, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))
    assert not step.optimizer.state


def test_task_losses_scale_each_task_by_its_share_of_the_batch(tiny_model, tiny_tokenizer, records):
    """Two micro-batches' losses of a task add up to the whole task's loss (grpo: rows, token_mean: tokens)."""
    for loss_type in ("grpo", "token_mean"):
        whole = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss={"loss_type": loss_type})
        split = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss={"loss_type": loss_type}, grad_accum=2)
        advantages = torch.linspace(-1, 1, 2 * len(records))
        batch = _batch(whole, records, advantages)
        totals = global_totals(whole, batch)
        full, _, _ = task_losses(whole, batch, totals, ("fairness",), 0)
        fresh = dataclasses.replace(batch, prefills=())  # the rollout's kept prefill is of whole's model
        halves = [task_losses(split, fresh, totals, ("fairness",), micro)[0] for micro in (0, 1)]
        total = sum(float(h["fairness"].policy) for h in halves)
        assert total == pytest.approx(float(full["fairness"].policy), abs=1e-6), loss_type


def test_a_token_mean_share_counts_tokens_and_a_grpo_share_rows(tiny_model, tiny_tokenizer, records):
    """A part's share of its task's loss: its rows over the task's rows (``grpo``), its completion tokens over
    the task's tokens (``token_mean``); the whole task's share is 1 either way."""
    step = make_step(tiny_model, tiny_tokenizer)
    batch = _batch(step, records)
    rows = batch.rows["fairness"]
    half = rows[: len(rows) // 2]
    mask = batch.completion_mask.clone()
    mask[half[0], 1:] = False  # one completion of a single token: the part's tokens are not its rows' share
    batch = dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, completion_mask=mask))
    totals = global_totals(step, batch)
    tokens = float(batch.completion_mask[half].sum())
    assert tokens / totals.tokens["fairness"] != pytest.approx(len(half) / totals.rows["fairness"])
    assert _share(batch, totals, "fairness", rows, "token_mean") == pytest.approx(1.0)
    assert _share(batch, totals, "fairness", rows, "grpo") == pytest.approx(1.0)
    assert _share(batch, totals, "fairness", half, "token_mean") == pytest.approx(tokens / totals.tokens["fairness"])
    assert _share(batch, totals, "fairness", half, "grpo") == pytest.approx(len(half) / totals.rows["fairness"])


def test_the_logged_statistics_do_not_depend_on_the_micro_batches(tiny_model, tiny_tokenizer, records):
    """Each micro-batch's statistics are weighted by its share of the task's completion tokens, so two
    micro-batches log what one pass over the batch logs (the rows' lengths differ: a share of rows would not)."""
    whole = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
    split = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, grad_accum=2)
    batch = _batch(whole, records, torch.linspace(-1, 1, 2 * len(records)))
    width = batch.completion_mask.shape[1]
    lengths = 1 + torch.arange(len(batch.advantages)) % width  # rows stopped after 1, 2, ... tokens
    mask = torch.arange(width) < lengths[:, None]
    inputs = dataclasses.replace(batch.inputs, completion_mask=mask,
                                 attention_mask=torch.cat([batch.inputs.attention_mask[:, :-width], mask.long()], 1))
    batch = dataclasses.replace(batch, inputs=inputs, prefills=())
    totals = global_totals(whole, batch)
    one = token_means(gradient(whole, batch, totals).task_stats, totals)
    two = token_means(gradient(split, batch, totals).task_stats, totals)
    assert set(one) == set(two) and "entropy" in one
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key


def test_logged_statistics_are_token_means_over_both_tasks():
    """The logged loss and logit statistics weigh each task by its completion tokens: 10 tokens at 1.0 and
    30 at 3.0 log 2.5, not the tasks' plain mean 2.0."""
    totals = Totals(rows={"fairness": 2.0, "hallucination": 2.0}, tokens={"fairness": 10.0, "hallucination": 30.0})
    stats = {"fairness": {"entropy": 1.0}, "hallucination": {"entropy": 3.0}}
    assert token_means(stats, totals) == {"entropy": pytest.approx(2.5)}


def test_i10_the_update_scores_at_the_rollouts_temperature(tiny_model, tiny_tokenizer, records):
    """At T = 0.7 with two updates per rollout, the update's first policy pass scores the very numbers the
    stored old log-probs hold (same forwards, same temperature): a pass that dropped T would not."""
    step = make_step(tiny_model, tiny_tokenizer, num_iterations=2,
                       sampling={"max_new_tokens": 5, "temperature": 0.7})
    batch = _batch(step, records, torch.linspace(-1, 1, 2 * len(records)))
    assert batch.inputs.temperature == 0.7 and batch.old_logprobs is not None
    _, first = update(step, batch)
    mask = batch.completion_mask
    assert torch.equal(first.logprobs[mask], batch.old_logprobs[mask])


@pytest.mark.parametrize("max_grad_norm", [1e-4, 1e6], ids=["clipped", "unclipped"])
def test_the_optimizer_steps_on_the_gradient_clipped_to_max_grad_norm(tiny_model, tiny_tokenizer, records,
                                                                         max_grad_norm):
    """The gradient the optimizer steps on has a global norm of at most ``grpo.max_grad_norm``, the logged
    ``grad_norm`` is the norm before clipping, and a gradient under the bound is left as it is."""
    step = make_step(tiny_model, tiny_tokenizer, max_grad_norm=max_grad_norm)
    batch = _batch(step, records, torch.linspace(-1, 1, 2 * len(records)))
    seen: list[float] = []
    step.optimizer.register_step_pre_hook(lambda *_: seen.append(
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in step.params])))))
    metrics, _ = update(step, batch)
    assert len(seen) == 1 and metrics["grad_norm"] > 1e-4, "a gradient large enough to clip"
    if max_grad_norm < metrics["grad_norm"]:
        assert seen[0] == pytest.approx(max_grad_norm, rel=1e-3)
    else:
        assert seen[0] == pytest.approx(metrics["grad_norm"], rel=1e-5)


def test_each_update_starts_from_no_gradient_and_moves_the_schedule_one_step(tiny_model, tiny_tokenizer, records):
    """Gradients left on the weights (by a caller, a probe, an earlier step) do not leak into the step: the
    optimizer steps on this batch's gradient alone; and the learning-rate schedule advances once per update,
    the lr logged being the scheduler's."""
    advantages = torch.linspace(-1, 1, 2 * len(records))
    seen = {}
    for dirty in (False, True):
        step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
        batch = _batch(step, records, advantages)
        if dirty:
            for p in step.params:
                p.grad = torch.full_like(p, 100.0)
        step.optimizer.register_step_pre_hook(
            lambda *_, step=step, dirty=dirty: seen.__setitem__(dirty, [p.grad.clone() for p in step.params]))
        before = step.scheduler.last_epoch
        metrics, _ = update(step, batch)
        assert step.scheduler.last_epoch == before + 1
        assert metrics["lr"] == step.scheduler.get_last_lr()[0]
    assert all(torch.equal(a, b) for a, b in zip(seen[True], seen[False], strict=True))
    assert max(float(g.abs().max()) for g in seen[False]) > 0
