"""A project on disk for the evaluation tests (tests/test_evaluate.py, tests/test_diagnose.py and others):
records from the data module's generators, a built tiny base model, the SFT copy with its lineage, a
GRPO adapter with its lineage."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from grpo import paths
from grpo.config import Config, TinyModelConfig, config_from_dict
from grpo.data.schema import make_record, record_line
from grpo.data.synthetic_fairness import generate_fairness
from grpo.data.synthetic_grounded import generate_grounded
from grpo.model.loading import load_model, load_tokenizer, save_model
from grpo.model.lora import wrap_lora
from grpo.model.tiny import build_tiny
from grpo.provenance.lineage import make_lineage, write_lineage

SIZES = TinyModelConfig(
    vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)
N_FAIR, N_HALL = 3, 3
MAX_NEW = 5
GROUP = 2


def make_records(split: str, n_fair: int, n_hall: int, seed: int) -> list[dict]:
    """Unified-schema records from the data module's synthetic generators (fairness first)."""
    raw = generate_fairness(n_fair, split, seed) + generate_grounded(n_hall, split, seed, 0.5)
    return [make_record(fields, split).model_dump(mode="json") for fields in raw]


def write_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(record_line(make_record(r, r["split"])) for r in records), encoding="utf-8")


def project_cfg(root: Path, **sections) -> Config:
    """A config whose every path lies under ``root``; ``sections`` are merged over the test defaults."""
    tree = {
        "experiment": "t",
        "paths": {f"{name}_dir": str(root / name) for name in ("data", "models", "metrics", "reports", "runs")},
        "model": {"tiny": SIZES.model_dump(), "lora": {"target_modules": ["q_proj", "v_proj", "lm_head"]}},
        "grpo": {"group_size": GROUP, "sampling": {"max_new_tokens": MAX_NEW}},
        "eval": {"samples_per_prompt": GROUP, "batch_size": 4, "diagnose": {"prompts": 2}},
    }
    for key, value in sections.items():
        tree[key] = tree.get(key, {}) | value
    return config_from_dict(tree)


def build_project(root: Path) -> Config:
    """Data, a built tiny base model, SFT = a copy of it with a matching lineage.json."""
    cfg = project_cfg(root)
    train = make_records("train", 4, 4, seed=1)
    evals = make_records("eval", N_FAIR, N_HALL, seed=2)
    write_records(Path(cfg.paths.data_dir) / "train.jsonl", train)
    write_records(Path(cfg.paths.data_dir) / "eval.jsonl", evals)
    texts = [r[key] for r in train for key in ("context", "question", "answer")]
    base = Path(cfg.paths.models_dir) / "base"
    build_tiny(base, texts, SIZES, seed=0)
    write_lineage(base, make_lineage("base", cfg, paths.stage_inputs(cfg, "base")))
    shutil.copytree(base, paths.model_dir(cfg, "sft"))
    write_lineage(paths.model_dir(cfg, "sft"), make_lineage("sft", cfg, paths.stage_inputs(cfg, "sft")))
    return cfg


def add_grpo_adapter(cfg: Config, scale: float = 0.5) -> Path:
    """A LoRA adapter on the SFT weights with random B (so it changes the model), plus its lineage."""
    torch.manual_seed(0)
    model = wrap_lora(load_model(paths.model_dir(cfg, "sft"), cfg.model), cfg.model.lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    save_model(model, load_tokenizer(paths.model_dir(cfg, "sft"), cfg.model), paths.model_dir(cfg, "grpo"))
    write_lineage(paths.model_dir(cfg, "grpo"), make_lineage("grpo", cfg, paths.stage_inputs(cfg, "grpo")))
    return paths.model_dir(cfg, "grpo")
