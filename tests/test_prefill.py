"""grpo/model/fast/prefill.py: the update reuses the rollout's prefill only where a fresh pass would be the very
same computation (``prefill_reusable``), and a forward that is random in training mode is never one
(``has_dropout``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.config import GrpoConfig
from grpo.model.fast.prefill import has_dropout, prefill_reusable
from tests.test_attention import QWEN_SHRUNK

SHARED = {"shares_prefix": True, "samples_on_model": True, "one_process": True}


def test_the_tiny_models_prefill_is_reusable_by_default(tiny_model):
    """The reference point of the cases below: every condition holds."""
    assert not has_dropout(tiny_model)
    assert prefill_reusable(GrpoConfig(), tiny_model, **SHARED)


@pytest.mark.parametrize("rate", ["attention_dropout", "hidden_dropout", "dropout", "attn_pdrop"])
def test_a_dropout_rate_in_the_config_is_dropout(tiny_model, rate):
    """Attention applies its config's rate in training mode with no dropout module to find (Llama's
    ``attention_dropout``): the update's pass would differ from the rollout's eval-mode prefill."""
    setattr(tiny_model.config, rate, 0.1)
    assert has_dropout(tiny_model)
    assert not prefill_reusable(GrpoConfig(), tiny_model, **SHARED)


def test_a_dropout_module_with_a_rate_is_dropout_and_one_at_zero_is_not(tiny_model):
    """A dropout module anywhere in the model (LoRA's, a head's) makes a training-mode forward random; one
    of rate 0 does not."""
    tiny_model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.0))
    assert not has_dropout(tiny_model)
    tiny_model.model.layers[0].mlp.drop.p = 0.1
    assert has_dropout(tiny_model)
    assert not prefill_reusable(GrpoConfig(), tiny_model, **SHARED)


@pytest.mark.parametrize("condition", ["shares_prefix", "samples_on_model", "one_process"])
def test_each_call_sites_condition_is_required(tiny_model, condition):
    """Another sampler, an unshared prompt pass, or several processes (DDP and FSDP wrap the update's
    forward): the update runs its own pass over the prompts."""
    assert not prefill_reusable(GrpoConfig(), tiny_model, **{**SHARED, condition: False})


def test_a_model_whose_attention_does_not_take_the_prepared_mask_runs_its_own_prefill():
    """Qwen2 with its sliding window on attends within a window: not the prepared causal+padding mask the
    rollout's prefill was computed with."""
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=4, **QWEN_SHRUNK)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert not has_dropout(model)
    assert not prefill_reusable(GrpoConfig(), model, **SHARED)
