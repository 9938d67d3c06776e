"""The ``base`` model: build the embedded tiny model from the project's own text, or resolve a real one.

The stage itself (``grpo/train/pretrain.py``) calls ``build_base`` and then pretrains the embedded model.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo import paths
from grpo.config import Config
from grpo.model.architectures import build_architecture, count_parameters, tokenizer_folder
from grpo.model.fast import FastPaths
from grpo.model.gguf import convert_gguf
from grpo.model.loading import load_model, load_tokenizer, save_model, write_pointer
from grpo.model.precision import fp32_head
from grpo.model.tiny import build_tiny
from grpo.sources import gguf_file, is_gguf


def base_inputs(cfg: Config) -> dict[str, Path]:
    """What ``models/base`` is made from: a preset's real tokenizer, a GGUF file, or ``paths.stage_inputs``."""
    if cfg.model.architecture is not None:
        return {"tokenizer": tokenizer_folder(cfg.model.architecture, cfg.model)}
    if cfg.model.name_or_path is not None and is_gguf(cfg.model.name_or_path):
        return {"gguf": gguf_file(cfg.model.name_or_path)}
    return paths.stage_inputs(cfg, "base")


def build_base(
    cfg: Config, out: Path, corpus: Iterable[str] = ()
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Write the configured base model to ``out``; return the embedded tiny model and its tokenizer
    (the one ``grpo/train/pretrain.py`` may pretrain), None for a preset or a resolved model.
    ``corpus`` is the text the embedded tokenizer is trained on (unused by other models)."""
    if cfg.model.architecture is not None:
        model, tokenizer = build_architecture(cfg.model, cfg.seed)
        save_model(model, tokenizer, out)
        print(
            f"base: {cfg.model.architecture} with random weights ({count_parameters(model) / 1e6:.1f}M "
            f"parameters, {cfg.model.dtype}) and its real tokenizer written to {out}"
        )
        return None
    if cfg.model.name_or_path is None:
        model, tokenizer = build_tiny(out, corpus, cfg.model.tiny, cfg.seed)
        fp32_head(model, FastPaths.resolve(cfg.model.fast_paths))  # the head pretraining runs
        print(f"base: embedded tiny Llama ({count_parameters(model) / 1e6:.2f}M parameters) written to {out}")
        return model, tokenizer
    if is_gguf(cfg.model.name_or_path):
        source = gguf_file(cfg.model.name_or_path)
        model, tokenizer = convert_gguf(source)
        save_model(model, tokenizer, out)
        print(
            f"base: {source.name} converted ({count_parameters(model) / 1e6:.1f}M parameters, fp32), its "
            f"tokenizer repaired from the file's metadata (eos {tokenizer.eos_token}, pad {tokenizer.pad_token}), "
            f"written to {out}"
        )
        return None
    # Load once so a bad path or a missing chat template fails here, not in SFT.
    load_tokenizer(cfg.model.name_or_path, cfg.model)
    load_model(cfg.model.name_or_path, cfg.model)
    write_pointer(out, cfg.model.name_or_path)
    print(f"base: {cfg.model.name_or_path} resolved; pointer written to {out}")
    return None
