"""grpo/model/scoring.py: the reference is the model with its adapter off, and only for that call (I9)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.config import config_from_dict
from grpo.core.batching import join_prompt_completion, left_pad
from grpo.model.lora import adapter_disabled, wrap_lora
from grpo.model.scoring import MissingReferenceError, RolloutInputs, score_inputs, score_reference


def _inputs(pad_id: int) -> RolloutInputs:
    gen = torch.Generator().manual_seed(0)
    prompts = left_pad([torch.randint(5, 300, (n,), generator=gen).tolist() for n in (6, 11, 6, 11)], pad_id)
    completions = torch.randint(5, 300, (4, 5), generator=gen)  # [N, C]
    completion_mask = torch.ones(4, 5, dtype=torch.bool)
    joined = join_prompt_completion(prompts.input_ids, prompts.attention_mask, completions, completion_mask)
    return RolloutInputs(joined.input_ids, joined.attention_mask, completion_mask, 0.8)


def test_reference_is_the_model_without_its_adapter_and_the_adapter_comes_back(tiny_model, tiny_tokenizer):
    sft = copy.deepcopy(tiny_model)
    policy = wrap_lora(tiny_model, config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    inputs = _inputs(tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        before = score_inputs(policy, inputs, shared_prefix=True).logprobs
        reference = score_reference(policy, inputs, shared_prefix=True).logprobs
        after = score_inputs(policy, inputs, shared_prefix=True).logprobs
        plain_sft = score_inputs(sft, inputs).logprobs
    torch.testing.assert_close(reference, plain_sft, rtol=0, atol=1e-5)
    assert (before - plain_sft).abs().max() > 1e-2, "the adapter changes the policy"
    assert torch.equal(after, before), "the adapter is on again after the reference pass"


def test_adapter_disabled_restores_each_layers_own_flag(tiny_model):
    policy = wrap_lora(tiny_model, config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    layers = [m for m in policy.modules() if hasattr(m, "_disable_adapters")]
    layers[0]._disable_adapters = True  # one layer already off stays off; the others come back on
    with adapter_disabled(policy):
        assert all(layer.disable_adapters for layer in layers)
    assert [layer.disable_adapters for layer in layers] == [True] + [False] * (len(layers) - 1)


def test_a_model_without_an_adapter_needs_its_frozen_reference(tiny_model, tiny_tokenizer):
    """Full fine-tuning has no adapter to switch off: the reference is the frozen SFT copy, and without it
    scoring the reference refuses (never scores the policy itself as its own reference)."""
    inputs = _inputs(tiny_tokenizer.pad_token_id)
    with pytest.raises(MissingReferenceError, match="model.lora.enabled: false"):
        score_reference(tiny_model, inputs)
    with torch.no_grad():
        given = score_reference(tiny_model, inputs, reference=tiny_model)
        assert torch.equal(given.logprobs, score_inputs(tiny_model, inputs).logprobs)
        assert torch.equal(given.entropy, score_inputs(tiny_model, inputs).entropy)  # the entropy by default


def test_the_scores_are_the_completions_under_the_temperature_entropy_included(tiny_model, tiny_tokenizer):
    """[N, C] log-probs of the sampled tokens under softmax(z / T) from the model's own logits, with the
    entropy by default (4 rows of 5 completion tokens: the width is the completions', not the rows')."""
    inputs = _inputs(tiny_tokenizer.pad_token_id)
    width = inputs.completion_mask.shape[1]
    with torch.no_grad():
        scored = score_inputs(tiny_model, inputs)
        logits = tiny_model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits
    log_probs = (logits[:, -width - 1 : -1].float() / inputs.temperature).log_softmax(-1)
    expected = log_probs.gather(-1, inputs.input_ids[:, -width:, None]).squeeze(-1)
    assert scored.logprobs.shape == (4, width) and scored.entropy is not None
    torch.testing.assert_close(scored.logprobs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(scored.entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-5)
