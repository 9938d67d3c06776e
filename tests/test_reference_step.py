"""grpo/checks/reference_step.py: the plain GRPO step the gate holds the trainer's to. Its pieces agree with
the project's fast functions on inputs where both are known, and it cuts, masks and scores by itself."""

from __future__ import annotations

import pytest
import torch

from grpo.checks import reference_step as plain
from grpo.config import MultitaskConfig
from grpo.core.advantages import group_advantages
from grpo.core.multitask import combine
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


@pytest.mark.parametrize("mode", ["pcgrad", "cagrad"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_written_out_combinations_are_the_projects(mode, seed):
    """PCGrad in the fixed task order and CAGrad's dual solved by golden section give the combination
    ``core.multitask.combine`` gives (which solves it by projected gradient descent)."""
    grads = torch.randn(2, 50, generator=torch.Generator().manual_seed(seed))
    grads[1] -= 1.5 * grads[0]  # conflicting
    want, _ = combine(grads, mode, c=0.5, rescale=1)
    got = plain._pcgrad(list(grads)) if mode == "pcgrad" else plain._cagrad(list(grads), 0.5, 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


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
