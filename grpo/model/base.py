"""Stage ``base``: build the embedded tiny model from the project's own text, or resolve a real one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from grpo import paths
from grpo.config import Config
from grpo.locks import writes
from grpo.model.modeling import build_tiny, load_model, load_tokenizer, write_pointer
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


@writes(lambda cfg: paths.model_dir(cfg, "base"))
def run(cfg: Config) -> int:
    out = paths.model_dir(cfg, "base")
    if cfg.model.name_or_path is None:
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
    write_lineage(out, make_lineage("base", cfg, paths.stage_inputs(cfg, "base")))
    return 0
