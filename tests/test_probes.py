"""grpo/checks/probes.py: a bounded check passes at its bound and fails above it and on NaN; the probes score
what they say, over the completion tokens, and the entropy step is of the asked size in the configured mode."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from grpo.checks.probes import bounded, entropy_step, mean_entropy, reference_entropy, reference_kl
from grpo.config import MultitaskConfig, config_from_dict
from grpo.core.batching import join_prompt_completion, left_pad
from grpo.model.lora import wrap_lora
from grpo.model.scoring import RolloutInputs, score_inputs


@pytest.mark.parametrize(("value", "status"), [(0.0, "pass"), (1e-6, "pass"), (1.0000001e-6, "fail"),
                                               (math.inf, "fail"), (math.nan, "fail")])
def test_a_bounded_check_passes_up_to_its_bound_and_never_on_nan(value, status):
    check = bounded("first_step", "I8, I9", value, 1e-6, "detail", "the fix")
    assert check.status == status and check.passed == (status == "pass")
    assert check.hint == ("" if status == "pass" else "the fix") and check.bound == 1e-6


def _policy_and_inputs(tiny_model, tiny_tokenizer):
    """The tiny model under a LoRA adapter that moves it, and four rows whose completions end early (pads
    after each row's end, masked out)."""
    with torch.no_grad():
        tiny_model.get_output_embeddings().weight.mul_(4.0)  # peaked distributions: entropies far apart
    sft = copy.deepcopy(tiny_model)
    torch.manual_seed(0)  # lora_A's initialisation
    policy = wrap_lora(tiny_model, config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    prompts = left_pad([torch.randint(5, 300, (n,), generator=gen).tolist() for n in (6, 11, 6, 11)],
                       tiny_tokenizer.pad_token_id)
    completions = torch.randint(5, 300, (4, 6), generator=gen)  # [N, C]
    mask = torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]  # [N, C]
    completions[~mask] = tiny_tokenizer.pad_token_id
    joined = join_prompt_completion(prompts.input_ids, prompts.attention_mask, completions, mask)
    return sft, policy, RolloutInputs(joined.input_ids, joined.attention_mask, mask, 0.8)


def test_the_probes_score_the_policy_against_its_reference_over_the_completion_tokens(tiny_model, tiny_tokenizer):
    """``reference_kl`` is the k3 estimate of KL(policy || reference), ``mean_entropy`` the policy's and
    ``reference_entropy`` the reference's (the adapter off), each a mean over the completion tokens only."""
    sft, policy, inputs = _policy_and_inputs(tiny_model, tiny_tokenizer)
    mask = inputs.completion_mask
    with torch.no_grad():
        ours, theirs = score_inputs(policy, inputs), score_inputs(sft, inputs)
    delta = (theirs.logprobs - ours.logprobs)[mask]
    torch.testing.assert_close(reference_kl(policy, inputs), float((delta.exp() - delta - 1).mean()), rtol=1e-4,
                               atol=1e-7)
    torch.testing.assert_close(mean_entropy(policy, inputs), float(ours.entropy[mask].mean()), rtol=1e-6, atol=0)
    torch.testing.assert_close(reference_entropy(policy, inputs), float(theirs.entropy[mask].mean()), rtol=1e-6,
                               atol=0)
    assert abs(float(ours.entropy[mask].mean() - theirs.entropy[mask].mean())) > 1e-3  # the two differ
    assert abs(float(ours.entropy[mask].mean() - ours.entropy.mean())) > 1e-3  # the padding would count


def test_the_entropy_step_has_the_asked_size_in_the_configured_combination(tiny_model, tiny_tokenizer):
    """The step is ``step_size`` long whatever the gradient's scale (ten times the coefficient: the same step,
    ten times the norm), and CAGrad's ``cagrad_c`` is the configured one (another c: another direction)."""
    _, policy, inputs = _policy_and_inputs(tiny_model, tiny_tokenizer)
    rows = {"fairness": torch.tensor([0, 2]), "hallucination": torch.tensor([1, 3])}

    def step(coef, c):
        multitask = MultitaskConfig(mode="cagrad", cagrad_c=c)
        return entropy_step(policy, inputs, rows, multitask, coef, step_size=0.05)

    before, after, norm = step(0.01, 0.5)
    again, after_ten, norm_ten = step(0.1, 0.5)
    assert again == before and after > before  # the weights were restored; the entropy rose
    assert norm_ten == pytest.approx(10 * norm, rel=1e-4)
    assert after_ten == pytest.approx(after, abs=1e-6)
    assert abs(step(0.01, 0.95)[1] - after) > 1e-4


def test_the_entropy_step_moves_each_weight_by_its_own_slice_of_the_direction(tiny_model, tiny_tokenizer, monkeypatch):
    """The weights the second entropy is measured on are the saved ones minus ``step_size`` along the unit
    combined gradient, weight by weight (LoRA's A and B have other sizes: a slice taken at the wrong offset
    moves them along another direction), and they are put back afterwards."""
    from grpo.checks import probes

    _, policy, inputs = _policy_and_inputs(tiny_model, tiny_tokenizer)
    rows = {"fairness": torch.tensor([0, 2]), "hallucination": torch.tensor([1, 3])}
    multitask = MultitaskConfig(mode="sum")
    params = [p for p in policy.parameters() if p.requires_grad]
    saved = torch.cat([p.detach().flatten() for p in params])
    direction = probes._entropy_direction(policy, params, inputs, rows, multitask, 0.01)
    policy.zero_grad(set_to_none=True)
    seen = []
    measure = probes.mean_entropy

    def recording(model, rows_inputs):
        seen.append(torch.cat([p.detach().flatten() for p in params]))
        return measure(model, rows_inputs)

    monkeypatch.setattr(probes, "mean_entropy", recording)
    _, _, norm = entropy_step(policy, inputs, rows, multitask, 0.01, step_size=0.05)
    assert norm == pytest.approx(float(direction.norm()), rel=1e-5)
    torch.testing.assert_close(seen[0], saved, rtol=0, atol=0)
    torch.testing.assert_close(seen[1], saved - 0.05 * direction / direction.norm(), rtol=0, atol=1e-6)
    assert torch.equal(torch.cat([p.detach().flatten() for p in params]), saved)
    assert all(p.grad is None for p in params)


def test_a_zero_entropy_gradient_takes_no_step(tiny_model, tiny_tokenizer):
    _, policy, inputs = _policy_and_inputs(tiny_model, tiny_tokenizer)
    rows = {"fairness": torch.tensor([0, 2]), "hallucination": torch.tensor([1, 3])}
    before, after, norm = entropy_step(policy, inputs, rows, MultitaskConfig(mode="sum"), 0.0, step_size=0.05)
    assert (after, norm) == (before, 0.0) and math.isfinite(before)
