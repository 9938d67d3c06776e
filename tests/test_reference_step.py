"""grpo/checks/reference_step.py: the plain GRPO step the gate holds the trainer's to. Its pieces agree with
the project's fast functions on inputs where both are known, and it cuts, masks and scores by itself."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo.checks import reference_step as plain
from grpo.config import MultitaskConfig
from grpo.core.advantages import group_advantages
from grpo.core.losses import agg_loss
from grpo.core.multitask import BatchGradients, combine, combine_task_gradients
from grpo.data.prompts import render_records
from grpo.model.rollout import stop_ids
from grpo.train.step import draw
from tests.gate_subjects import CFG, random_model_for, subject_for
from tests.steps import step_records


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_loop_advantages_are_the_vectorised_ones(scale):
    rewards = [1.0, 0.0, -1.0, 0.5, 0.1, 0.1, 0.1, 0.1, -0.5, 1.0, 1.0, 0.0]  # one equal group (inexact mean)
    want, _ = group_advantages(torch.tensor(rewards), 4, scale)
    got = plain._advantages(rewards, 4, scale)
    assert got[4:8] == [0.0] * 4
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("mode", "rescale"), [("pcgrad", 1), ("cagrad", 0), ("cagrad", 1), ("cagrad", 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_written_out_combinations_are_the_projects(mode, rescale, seed):
    """PCGrad in the fixed task order and CAGrad's dual solved by golden section give the combination
    ``core.multitask.combine`` gives (which solves it by projected gradient descent), in every rescaling."""
    grads = torch.randn(2, 50, generator=torch.Generator().manual_seed(seed))
    grads[1] -= 1.5 * grads[0]  # conflicting
    want, _ = combine(grads, mode, c=0.5, rescale=rescale)
    got = plain._pcgrad(list(grads)) if mode == "pcgrad" else plain._cagrad(list(grads), 0.5, rescale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "token_mean"])
def test_the_written_out_aggregation_is_the_projects(loss_type):
    """Rows of unequal lengths: each loss type's normaliser (rows' means, rows x max_new_tokens, tokens) is
    ``core.losses.agg_loss``'s over the same values padded and masked."""
    rows = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0, 4.0, 0.5]), torch.tensor([2.5])]
    width = 6
    padded = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        padded[i, : len(row)], mask[i, : len(row)] = row, True
    want = agg_loss(padded, mask, loss_type, width)
    torch.testing.assert_close(plain._aggregate(rows, loss_type, width), want)


@pytest.mark.parametrize("mode", ["sum", "pcgrad", "cagrad"])
@pytest.mark.parametrize("reward_only", [False, True])
def test_a_task_with_nothing_to_learn_takes_no_part_as_in_the_trainer(mode, reward_only):
    """One task's gradient exactly zero: the written-out direction leaves it out, as the trainer's
    ``combine_task_gradients`` does (a zero gradient would halve CAGrad's mean)."""
    g = torch.randn(40, generator=torch.Generator().manual_seed(4))
    regulariser = 0.1 * torch.randn(40, generator=torch.Generator().manual_seed(5))
    zero = torch.zeros(40)
    step = plain.ReferenceStep(*([None] * 9), 0.0, 0.0, {"fairness": g, "hallucination": zero},
                               {"fairness": regulariser, "hallucination": zero}, {})
    multitask = MultitaskConfig(mode=mode, reward_only=reward_only, cagrad_c=0.5, cagrad_rescale=1)
    trainer = BatchGradients({"fairness": g if reward_only else g + regulariser, "hallucination": zero},
                             regulariser if reward_only else None)
    want, _ = combine_task_gradients(trainer, ["fairness", "hallucination"], zero, mode=mode, c=0.5, rescale=1)
    torch.testing.assert_close(step.direction(multitask), want, rtol=1e-4, atol=1e-6)


def test_the_greedy_choice_bans_stops_before_min_new_tokens_and_penalises_presence_once():
    """Stop tokens at -inf at columns 0 .. min_new_tokens - 1 only; the presence penalty once per token seen,
    the frequency penalty once per occurrence."""
    cfg = CFG.model_copy(update={"grpo": CFG.grpo.model_copy(update={"sampling": CFG.grpo.sampling.model_copy(
        update={"min_new_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25})})})
    logits = torch.zeros(6)
    for column in range(4):
        z = plain._greedy_choice(logits.clone(), [1, 1, 3], {5}, column, cfg)
        assert (z[5] == -math.inf) == (column < 2), column
        assert z[1].item() == pytest.approx(-0.5 - 2 * 0.25)  # seen twice: presence once, frequency twice
        assert z[3].item() == pytest.approx(-0.5 - 0.25)
        assert z[0].item() == 0.0


def test_the_extra_stop_tokens_are_stop_tokens(tiny_model, tiny_tokenizer):
    extra = next(t for t in tiny_tokenizer.all_special_tokens
                 if tiny_tokenizer.convert_tokens_to_ids(t) not in plain.stop_tokens(tiny_tokenizer, tiny_model, (), {}))
    stops = plain.stop_tokens(tiny_tokenizer, tiny_model, (extra,), {})
    assert tiny_tokenizer.convert_tokens_to_ids(extra) in stops


class _FixedLogits(torch.nn.Module):
    """A "model" whose logits at every position are ``row``: greedy decoding's choice is known."""

    def __init__(self, row: torch.Tensor) -> None:
        super().__init__()
        self.row, self.weight = row, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.row.expand(*input_ids.shape, -1).clone())


def test_greedy_problems_forgive_ties_and_check_the_stop_token(tiny_tokenizer):
    """Token 7 leads token 8 by less than ``TIE_BOUND`` (either may be decoded), token 9 is far behind; a row
    that ends on a stop token greedy would not pick is a problem, as is one that picks 9."""
    cfg = CFG.model_copy(update={"grpo": CFG.grpo.model_copy(update={
        "group_size": 1, "sampling": CFG.grpo.sampling.model_copy(update={"max_new_tokens": 3, "min_new_tokens": 0})})})
    records = step_records()[:1]
    stop = next(iter(plain.stop_tokens(tiny_tokenizer, _FixedLogits(torch.zeros(2)), (), {})))
    row = torch.full((len(tiny_tokenizer),), -5.0)
    row[7], row[8], row[9] = 3.0, 3.0 - plain.TIE_BOUND / 2, 1.0
    policy = _FixedLogits(row)
    prompt = torch.tensor(render_records(tiny_tokenizer, records, {})[0])

    def problems(completion):
        return plain.greedy_problems(cfg, policy, tiny_tokenizer, records, torch.cat([prompt, torch.tensor(completion)])[None])

    assert problems([7, 8, 7]) == []
    assert problems([7, 9, 7]) == ["row 0, token 1: decoded 9, its prompt alone gives 7"]
    assert problems([8, stop]) == [f"row 0, token 1: decoded {stop}, its prompt alone gives 7"]


def test_the_stop_tokens_are_found_by_rendering(tiny_model, tiny_tokenizer):
    assert plain.stop_tokens(tiny_tokenizer, tiny_model, (), {}) == set(stop_ids(tiny_model, tiny_tokenizer))


def test_it_renders_cuts_and_masks_by_itself(tiny_tokenizer):
    """On a real rollout: its own prompts are the renderer's, each completion ends at the first stop token
    (the decode loop's pads after it dropped), its texts are the completions decoded."""
    subject = subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, step_records())
    drawn = draw(subject.step, subject.records, seed=3)
    ref = plain.reference_step(CFG, subject.policy, subject.sft, tiny_tokenizer, subject.records,
                               drawn.rollout.sequences)
    g = CFG.grpo.group_size
    assert ref.prompts == [p for p in render_records(tiny_tokenizer, subject.records, {}) for _ in range(g)]
    stops = set(subject.eos_ids)
    for completion, length in zip(ref.completions, drawn.rollout.lengths.tolist(), strict=True):
        assert len(completion) == length
        assert all(t not in stops for t in completion[:-1])
    assert ref.texts == drawn.rollout.texts
    assert len(ref.logprobs) == len(ref.prompts) and all(len(lp) == len(c) for lp, c in zip(ref.logprobs,
                                                                                          ref.completions, strict=True))
    assert set(ref.policy_grads) == {r["task"] for r in subject.records}
    assert ref.direction(MultitaskConfig(mode="sum")).shape == ref.policy_grads["fairness"].shape
