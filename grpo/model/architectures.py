"""Published architectures with random weights and their real tokenizers (``model.architecture``).

Nothing can be downloaded at run time, so GPU tests and benchmarks at real sizes build the exact
published configuration (numbers from each model's ``config.json`` on the hub) with random weights,
and load the real tokenizer from ``model.tokenizers_dir``. The result is saved like any local model
folder, so every later stage takes the same path as a user's pretrained checkpoint.
``model.architecture_overrides`` shrinks a preset (e.g. two layers) for fast CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo.config import Architecture, ModelConfig
from grpo.model.chat import end_of_turn_ids
from grpo.model.fast import FastPaths
from grpo.model.kernels import attention_kernel
from grpo.model.loading import ModelLoadError, load_tokenizer
from grpo.model.precision import fp32_head

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Preset:
    """One published architecture: its ``config.json`` numbers and the tokenizer folder it uses."""

    model_type: str
    tokenizer: str  # subfolder of model.tokenizers_dir
    config: dict[str, Any]
    generation_eos: tuple[int, ...]  # the model's generation_config.json eos ids
    parameters: int  # published parameter count (tied embeddings counted once)
    extra: dict[str, Any] = field(default_factory=dict)


def _qwen25(hidden: int, intermediate: int, layers: int, heads: int, parameters: int) -> Preset:
    config = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=151643,
        eos_token_id=151645,
    )
    return Preset("qwen2", "qwen2.5-0.5b-instruct", config, (151645, 151643), parameters)


def _llama3(
    hidden: int,
    layers: int,
    heads: int,
    head_dim: int,
    parameters: int,
    intermediate: int = 8192,
    tied: bool = True,
    rope_factor: float = 32.0,
) -> Preset:
    config = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=head_dim,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA3_ROPE | {"factor": rope_factor},
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        hidden_act="silu",
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    )
    return Preset("llama", "llama-3.2-instruct", config, (128001, 128008, 128009), parameters)


# Qwen2.5 -Instruct models share one tokenizer; so do Llama-3.2 1B and 3B, and Llama-3.1 8B (the same
# 128,256-token vocabulary; its chat template differs only in the default system turn's text).
PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, parameters=494_032_768),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, parameters=1_543_714_304),
    "llama-3.2-1b": _llama3(2048, 16, 32, 64, parameters=1_235_814_400),
    "llama-3.2-3b": _llama3(3072, 28, 24, 128, parameters=3_212_749_824),
    "llama-3.1-8b": _llama3(
        4096, 32, 32, 128, parameters=8_030_261_248, intermediate=14336, tied=False, rope_factor=8.0
    ),
}
assert set(PRESETS) == set(get_args(Architecture)), "grpo.config.Architecture lists the preset names"


def preset_config(name: str, overrides: dict[str, int] | None = None, attn_implementation: str = "sdpa"):
    """The transformers config of preset ``name`` with ``overrides`` applied (names checked)."""
    preset = PRESETS[name]
    unknown = sorted(set(overrides or {}) - set(preset.config))
    if unknown:
        raise ModelLoadError(
            f"model.architecture_overrides: {unknown} are not numbers of the {name} preset; use keys "
            f"among {sorted(k for k, v in preset.config.items() if isinstance(v, int | float))}"
        )
    config = AutoConfig.for_model(preset.model_type, **(preset.config | (overrides or {})))
    config._attn_implementation = attention_kernel(attn_implementation)
    return config


def tokenizer_folder(name: str, cfg: ModelConfig) -> Path:
    """Where the real tokenizer of preset ``name`` lives: ``<model.tokenizers_dir>/<its folder>``."""
    return Path(cfg.tokenizers_dir).expanduser() / PRESETS[name].tokenizer


def architecture_tokenizer(name: str, cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The real tokenizer of preset ``name`` from ``cfg.tokenizers_dir``, left-padded (``load_tokenizer``)."""
    folder = tokenizer_folder(name, cfg)
    if not folder.is_dir():
        raise ModelLoadError(
            f"model.tokenizers_dir: {str(folder)!r} (the tokenizer of model.architecture={name}) does not "
            "exist; set model.tokenizers_dir to the folder holding the real tokenizers"
        )
    return load_tokenizer(folder, cfg)


def build_architecture(
    cfg: ModelConfig, seed: int, device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Random weights (from ``seed``) in the preset's architecture, in ``cfg.dtype``, with its tokenizer,
    initialised on ``device`` (a GPU draws an 8B model's weights in seconds, a CPU in minutes; the draws
    differ between devices)."""
    name = cfg.architecture
    if name is None:
        raise ModelLoadError("model.architecture is null; name a preset such as qwen2.5-0.5b")
    config = preset_config(name, cfg.architecture_overrides, cfg.attn_implementation)  # the overrides, before any file is read
    tokenizer = architecture_tokenizer(name, cfg)
    if len(tokenizer) > config.vocab_size:
        raise ModelLoadError(
            f"model.architecture_overrides: vocab_size {config.vocab_size} is smaller than the {name} "
            f"tokenizer ({len(tokenizer)} tokens); leave vocab_size at the published value"
        )
    config.pad_token_id = tokenizer.pad_token_id
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype))
    eos = list(dict.fromkeys([*PRESETS[name].generation_eos, *end_of_turn_ids(tokenizer)]))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    return fp32_head(model, FastPaths.resolve(cfg.fast_paths)), tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once), as model cards report them."""
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, overrides: dict[str, int] | None = None) -> PreTrainedModel:
    """The preset on the meta device: shapes and counts without memory or initialisation time."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(preset_config(name, overrides))
