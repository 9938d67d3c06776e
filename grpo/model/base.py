"""Stage ``base``: build the embedded tiny model from the project's own text, or resolve a real one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from grpo import paths
from grpo.config import Config
from grpo.locks import writes
from grpo.model.architectures import build_architecture, count_parameters, tokenizer_folder
from grpo.model.modeling import build_tiny, load_model, load_tokenizer, save_model, write_pointer
from grpo.provenance.lineage import make_lineage, write_lineage

TEXT_FIELDS = ("context", "question", "answer")


def corpus_texts(train_file: Path) -> Iterator[str]:
    """The text fields of the training records (the tokenizer's own training text)."""
    if not train_file.is_file():
        return
    with train_file.open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            yield from (record[key] for key in TEXT_FIELDS if record.get(key))
            yield from record.get("choices") or ()


def base_inputs(cfg: Config) -> dict[str, Path]:
    """What ``models/base`` is made from: a preset's real tokenizer, or ``paths.stage_inputs``."""
    if cfg.model.architecture is not None:
        return {"tokenizer": tokenizer_folder(cfg.model.architecture, cfg.model)}
    return paths.stage_inputs(cfg, "base")


@writes(lambda cfg: paths.model_dir(cfg, "base"))
def run(cfg: Config) -> int:
    out = paths.model_dir(cfg, "base")
    if cfg.model.architecture is not None:
        model, tokenizer = build_architecture(cfg.model, cfg.seed)
        save_model(model, tokenizer, out)
        print(f"base: {cfg.model.architecture} with random weights ({count_parameters(model) / 1e6:.1f}M "
              f"parameters, {cfg.model.dtype}) and its real tokenizer written to {out}")
    elif cfg.model.name_or_path is None:
        texts = corpus_texts(paths.data_file(cfg, "train"))
        model, _ = build_tiny(out, texts, cfg.model.tiny, cfg.seed)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"base: embedded tiny Llama ({n_params / 1e6:.2f}M parameters) written to {out}")
    else:
        # Load once so a bad path or a missing chat template fails here, not in SFT.
        load_tokenizer(cfg.model.name_or_path, cfg.model)
        load_model(cfg.model.name_or_path, cfg.model)
        write_pointer(out, cfg.model.name_or_path)
        print(f"base: {cfg.model.name_or_path} resolved; pointer written to {out}")
    write_lineage(out, make_lineage("base", cfg, base_inputs(cfg)))
    return 0
