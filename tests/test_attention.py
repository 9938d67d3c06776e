"""grpo/core/attention.py: the prepared 4D mask gives the model's own numbers, with and without a cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.core.attention import causal_padding_mask, model_attention_mask, takes_prepared_mask
from grpo.core.batching import left_pad, position_ids_from_mask
from grpo.model.architectures import preset_config
from tests.weights import spread_weights

QWEN_SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512}


def _batch(pad_id: int, vocab: int, lengths=(9, 3, 14, 6)):
    gen = torch.Generator().manual_seed(0)
    return left_pad([torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths], pad_id)


def _varied(model):
    """Weights large enough that every position's logits depend on what it attends to."""
    return spread_weights(model, torch.Generator().manual_seed(0)).eval()


def _models(tiny_model):
    qwen = AutoModelForCausalLM.from_config(preset_config("qwen2.5-0.5b", QWEN_SHRUNK))
    return {"tiny-llama": tiny_model, "qwen2.5-shrunk": qwen}


@pytest.mark.parametrize("implementation", ["sdpa_grouped", "sdpa", "eager"])
@pytest.mark.parametrize("name", ["tiny-llama", "qwen2.5-shrunk"])
def test_prepared_mask_gives_the_models_own_logits(tiny_model, name, implementation):
    model = _varied(_models(tiny_model)[name])
    model.config._attn_implementation = implementation
    assert takes_prepared_mask(model), "the prepared path is the one under test"
    batch = _batch(0, model.config.vocab_size)
    ids, mask = batch.input_ids, batch.attention_mask
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        prepared_mask = model_attention_mask(model, mask, ids.shape[1])
        assert prepared_mask.dim() == 4
        prepared = model(input_ids=ids, attention_mask=prepared_mask, position_ids=positions).logits
        real = mask.bool()
        torch.testing.assert_close(prepared[real], own[real], rtol=0, atol=1e-6)
        # With a cache: the first columns, then the rest against it (the decode loop's and prefix's shape).
        cut = 10
        first = model(input_ids=ids[:, :cut], attention_mask=model_attention_mask(model, mask[:, :cut], cut),
                      position_ids=positions[:, :cut], use_cache=True)
        rest = model(input_ids=ids[:, cut:], attention_mask=model_attention_mask(model, mask, ids.shape[1] - cut),
                     position_ids=positions[:, cut:], past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(rest[real[:, cut:]], own[:, cut:][real[:, cut:]], rtol=0, atol=1e-5)


def test_causal_padding_mask_values():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = causal_padding_mask(mask, 2)  # the last two columns are the queries
    assert out.shape == (2, 1, 2, 4)
    assert out[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert out[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(causal_padding_mask(mask, 1), mask.bool()[:, None, None, :])


def test_models_whose_mask_means_more_get_the_2d_mask(tiny_model):
    mask = torch.ones(2, 5, dtype=torch.long)
    tiny_model.config.sliding_window = 4
    assert not takes_prepared_mask(tiny_model)
    assert model_attention_mask(tiny_model, mask, 5) is mask
    tiny_model.config.sliding_window = None
    tiny_model.config._attn_implementation = "flash_attention_2"
    assert model_attention_mask(tiny_model, mask, 5) is mask


def test_a_model_with_any_layer_not_full_attention_gets_the_2d_mask(tiny_model):
    """Interleaved layers (sliding attention beside full attention, as Gemma's) build their own mask per
    layer from the 2D one: one prepared causal mask for all of them would widen the windowed layers' reach."""
    mask = torch.ones(2, 5, dtype=torch.long)
    tiny_model.config._attn_implementation = "sdpa"
    tiny_model.config.sliding_window = None
    tiny_model.config.layer_types = ["full_attention", "sliding_attention"]
    assert not takes_prepared_mask(tiny_model)
    assert model_attention_mask(tiny_model, mask, 5) is mask
    tiny_model.config.layer_types = ["full_attention", "full_attention"]
    assert takes_prepared_mask(tiny_model)
    assert model_attention_mask(tiny_model, mask, 5).shape == (2, 1, 5, 5)


def test_a_module_without_a_config_gets_the_2d_mask():
    """A wrapped or plain module says nothing of its attention: nothing is assumed of it."""
    mask = torch.ones(2, 5, dtype=torch.long)
    plain = torch.nn.Linear(4, 4)
    assert not takes_prepared_mask(plain) and model_attention_mask(plain, mask, 5) is mask
