"""grpo/model/architectures.py: published presets, shrunk copies with the real tokenizers, the base stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.config import ConfigError, ModelConfig, config_from_dict
from grpo.data.prompts import example_messages
from grpo.model.architectures import (
    PRESETS,
    build_architecture,
    count_parameters,
    meta_model,
    tokenizer_folder,
)
from grpo.model.chat import render_prompt
from grpo.model.loading import ModelLoadError, load_model, load_tokenizer
from tests.conftest import real_tokenizer_path

# Shrunk to seconds on CPU; the vocabulary (the real tokenizer's) stays published.
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA_SHRINK = SHRINK | {"head_dim": 16}

PUBLISHED = [
    # name,          hidden, layers, heads, kv, intermediate, vocab,  parameters
    ("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, 494_032_768),
    ("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, 1_543_714_304),
    ("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, 1_235_814_400),
    ("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, 3_212_749_824),
    ("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, 8_030_261_248),
]


@pytest.mark.parametrize("name, hidden, layers, heads, kv, intermediate, vocab, parameters", PUBLISHED)
def test_full_size_presets_have_the_published_numbers(name, hidden, layers, heads, kv, intermediate, vocab,
                                                       parameters):
    """The config numbers and the parameter count of each model card (built on the meta device)."""
    model = meta_model(name)
    config = model.config
    got = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
           config.num_key_value_heads, config.intermediate_size, config.vocab_size)
    assert got == (hidden, layers, heads, kv, intermediate, vocab)
    assert count_parameters(model) == parameters
    assert config.tie_word_embeddings == (parameters < 8e9), "the 8B model has its own output head"


def _tokenizers_dir(name: str) -> str:
    """The folder holding preset ``name``'s real tokenizer: the repository's fixtures, or the shared folder."""
    return str(real_tokenizer_path(PRESETS[name].tokenizer).parent)


def _cfg(name: str, **extra: int) -> ModelConfig:
    overrides = (LLAMA_SHRINK if name.startswith("llama") else SHRINK) | extra
    return ModelConfig(architecture=name, architecture_overrides=overrides, tokenizers_dir=_tokenizers_dir(name))


@pytest.mark.parametrize("name, model_class, end_of_turn", [
    ("qwen2.5-0.5b", "Qwen2ForCausalLM", "<|im_end|>"),
    pytest.param("llama-3.2-1b", "LlamaForCausalLM", "<|eot_id|>", marks=pytest.mark.needs_shared),
])
def test_shrunk_preset_builds_with_the_real_tokenizer(name, model_class, end_of_turn):
    model, tokenizer = build_architecture(_cfg(name), seed=3)
    assert type(model).__name__ == model_class
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == PRESETS[name].config["vocab_size"]
    assert model.config._attn_implementation == "sdpa_grouped"  # model.attn_implementation: sdpa
    assert tokenizer.padding_side == "left" and len(tokenizer) > 100_000
    assert tokenizer.convert_tokens_to_ids(end_of_turn) in model.generation_config.eos_token_id
    published = list(PRESETS[name].generation_eos)  # the model's own generation_config eos ids, every one
    assert model.generation_config.eos_token_id[: len(published)] == published
    record = {"task": "hallucination", "context": "Elbrook was founded in 1821.", "question": "When?",
              "answer": "1821", "answerable": True}
    ids = render_prompt(tokenizer, example_messages(record))
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
    again, _ = build_architecture(_cfg(name), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_base_stage_writes_a_preset_that_loads_like_a_pretrained_folder(tmp_path):
    """`grpo base --set model.architecture=qwen2.5-0.5b` (shrunk): a local folder every stage loads."""
    from grpo.train.pretrain import run

    tree = {"paths": {"models_dir": str(tmp_path / "models"), "data_dir": str(tmp_path / "data"),
                      "metrics_dir": str(tmp_path / "metrics")},
            "model": {"architecture": "qwen2.5-0.5b", "architecture_overrides": SHRINK,
                      "tokenizers_dir": _tokenizers_dir("qwen2.5-0.5b")}}
    cfg = config_from_dict(tree)
    assert run(cfg) == 0
    out = tmp_path / "models" / "base"
    assert (out / "model.safetensors").is_file() and (out / "lineage.json").is_file()
    model, tokenizer = load_model(out, cfg.model), load_tokenizer(out, cfg.model)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.hidden_size == 64
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_unknown_override_names_the_key_and_the_choices(tmp_path):
    """The override is refused before any tokenizer is looked for: whatever model.tokenizers_dir holds."""
    for tokenizers_dir in (_tokenizers_dir("qwen2.5-0.5b"), str(tmp_path / "nowhere")):
        cfg = ModelConfig(architecture="qwen2.5-0.5b", architecture_overrides={"num_layers": 2},
                          tokenizers_dir=tokenizers_dir)
        with pytest.raises(ModelLoadError, match=r"architecture_overrides: \['num_layers'\].*num_hidden_layers"):
            build_architecture(cfg, seed=0)


def test_the_vocabulary_may_shrink_to_the_tokenizers_size_and_no_further():
    from grpo.model.architectures import architecture_tokenizer

    size = len(architecture_tokenizer("qwen2.5-0.5b", _cfg("qwen2.5-0.5b")))
    model, _ = build_architecture(_cfg("qwen2.5-0.5b", vocab_size=size), seed=0)
    assert model.config.vocab_size == size
    with pytest.raises(ModelLoadError, match=f"vocab_size {size - 1} is smaller than the qwen2.5-0.5b tokenizer"):
        build_architecture(_cfg("qwen2.5-0.5b", vocab_size=size - 1), seed=0)


def test_a_tokenizers_dir_under_home_is_expanded():
    cfg = ModelConfig(architecture="qwen2.5-0.5b", tokenizers_dir="~/tokenizers")
    assert tokenizer_folder("qwen2.5-0.5b", cfg) == Path.home() / "tokenizers" / "qwen2.5-0.5b-instruct"


def test_missing_tokenizers_dir_names_the_folder_and_the_fix(tmp_path):
    cfg = ModelConfig(architecture="llama-3.2-1b", tokenizers_dir=str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"nowhere/llama-3.2-instruct.*set model.tokenizers_dir"):
        build_architecture(cfg, seed=0)


def test_architecture_and_name_or_path_together_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model.*architecture .*name_or_path.*set one to null"):
        config_from_dict({"model": {"architecture": "qwen2.5-0.5b", "name_or_path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"model.architecture.*qwen2.5-0.5b"):
        config_from_dict({"model": {"architecture": "qwen-7b"}})


@pytest.mark.parametrize("name, factor", [("llama-3.2-1b", 32.0), ("llama-3.2-3b", 32.0), ("llama-3.1-8b", 8.0)])
def test_llama_presets_have_their_published_rope_scaling(name, factor):
    """Each config.json's llama3 RoPE scaling: factor 32 for Llama-3.2, 8 for Llama-3.1 8B."""
    rope = meta_model(name).config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == factor
    assert rope["original_max_position_embeddings"] == 8192


def test_a_preset_is_built_in_the_configured_dtype_with_the_tokenizers_pad():
    """``model.dtype`` is the weights' dtype; the tokenizer's pad is the model's (its embedding's padding row)."""
    cfg = _cfg("qwen2.5-0.5b").model_copy(update={"dtype": "bfloat16"})
    model, tokenizer = build_architecture(cfg, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.pad_token_id == tokenizer.pad_token_id == model.generation_config.pad_token_id
    assert model.get_input_embeddings().padding_idx == tokenizer.pad_token_id
