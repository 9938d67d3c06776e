"""grpo/model/tiny.py: the embedded tiny model, real loading by path, LoRA wrapping."""

from __future__ import annotations

import pytest
import torch

from grpo.config import LoraConfig, ModelConfig
from grpo.model.loading import ModelLoadError, load_model, load_tokenizer
from grpo.model.lora import wrap_lora
from grpo.model.tiny import EOS, EOT, SPECIAL_TOKENS, build_tiny


def test_tiny_tokenizer_has_llama3_specials_and_pad_equal_eot(tiny_tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tiny_tokenizer.convert_tokens_to_ids(token)
        assert ids != tiny_tokenizer.unk_token_id and tiny_tokenizer.decode([ids]) == token
    assert tiny_tokenizer.pad_token == EOT == tiny_tokenizer.eos_token
    assert tiny_tokenizer.padding_side == "left"
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tiny_tokenizer_round_trips_any_text(tiny_tokenizer):
    for text in ("Zürich's café — 42 ünïcödé words never seen in training!", "Hello , world . It 's do n't"):
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special_tokens=False)) == text


def test_build_save_load_round_trip(tmp_path, tiny_sizes):
    model, tokenizer = build_tiny(tmp_path / "base", ["some text about a river town"], tiny_sizes, seed=3)
    assert (tmp_path / "base" / "model.safetensors").is_file()
    loaded = load_model(tmp_path / "base", ModelConfig())
    reloaded_tok = load_tokenizer(tmp_path / "base", ModelConfig())
    assert reloaded_tok.pad_token_id == tokenizer.pad_token_id and reloaded_tok.padding_side == "left"
    ids = torch.tensor([tokenizer.encode("a river town", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=0)


def test_same_seed_same_weights(tiny_tokenizer, tiny_sizes):
    from grpo.model.tiny import build_tiny_model

    a = build_tiny_model(tiny_tokenizer, tiny_sizes, seed=5)
    b = build_tiny_model(tiny_tokenizer, tiny_sizes, seed=5)
    c = build_tiny_model(tiny_tokenizer, tiny_sizes, seed=6)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)



def test_the_tiny_model_has_its_configured_heads_and_stops_at_end_of_turn_and_end_of_text(tiny_tokenizer, tiny_sizes):
    from grpo.model.tiny import build_tiny_model

    model = build_tiny_model(tiny_tokenizer, tiny_sizes, seed=5)
    assert model.config.num_key_value_heads == tiny_sizes.num_key_value_heads == 2
    assert model.config.num_attention_heads == tiny_sizes.num_attention_heads == 4
    stops = [tiny_tokenizer.convert_tokens_to_ids(t) for t in (EOT, EOS)]
    assert model.generation_config.eos_token_id == stops == model.config.eos_token_id


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing"), ModelConfig())


def test_folder_without_model_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="nothing is downloaded"):
        load_model(str(tmp_path / "empty"), ModelConfig())


def test_real_tokenizers_get_a_pad_token_and_left_padding(real_tokenizer):
    assert real_tokenizer.pad_token_id is not None
    assert real_tokenizer.padding_side == "left"


@pytest.mark.needs_shared
def test_pad_token_from_params(tmp_path):
    from tests.conftest import real_tokenizer_path

    path = real_tokenizer_path("llama-3.2-instruct")
    tok = load_tokenizer(path, ModelConfig(pad_token="<|finetune_right_pad_id|>"))
    assert tok.pad_token_id == 128004 and tok.pad_token_id != tok.eos_token_id


def test_lora_wraps_only_adapters_trainable(tiny_model):
    model = wrap_lora(tiny_model, LoraConfig(enabled=True, r=2, alpha=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_bad_target_names_the_module(tiny_model):
    with pytest.raises(ValueError, match="nope_proj"):
        wrap_lora(tiny_model, LoraConfig(target_modules=["nope_proj"]))


def test_saved_tiny_tokenizer_works_with_a_standard_pipeline(tmp_path, tiny_sizes):
    """The embedded model as saved works with standard Hugging Face tools as it is: the tokenizer
    emits no token_type_ids (Llama's generate() rejects them), so pipeline and TRL can call it."""
    from transformers import pipeline

    build_tiny(tmp_path / "base", ["some text about a river town"], tiny_sizes, seed=3)
    tokenizer = load_tokenizer(tmp_path / "base", ModelConfig())
    assert set(tokenizer("a river town")) == {"input_ids", "attention_mask"}
    generator = pipeline("text-generation", model=str(tmp_path / "base"), device="cpu")
    out = generator("a river town", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("a river town")
