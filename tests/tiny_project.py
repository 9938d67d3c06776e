"""A tiny params tree and a prepared project (data, base, SFT, pre-flight) for end-to-end tests."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import yaml

from grpo.cli import main as grpo_main
from grpo.config import config_from_dict, config_to_dict

DEFAULT_MONITOR = config_to_dict(config_from_dict({}))["monitor"]

WARN_ONLY_RULES = (
    "boundary_header", "boundary_end_of_turn", "boundary_prompt_echo", "boundary_empty",
    "boundary_entropy_low", "entropy_floor", "reward_zero_std", "zero_grad",
)


def tiny_params(root: Path, **overrides) -> dict:
    """Params small enough for a CPU test: a 2-layer 64-wide model, 48 records, a few GRPO steps.

    The tiny model barely learns in one SFT epoch, so the collapse/boundary rules are set to warn
    (their own tests feed them recorded streams); everything else is the real configuration.
    """
    tree = {
        "seed": 7,
        "experiment": "tiny",
        "paths": {name: str(root / sub) for name, sub in (
            ("data_dir", "data/processed"), ("models_dir", "models"), ("metrics_dir", "metrics"),
            ("reports_dir", "reports"), ("runs_dir", "runs"))},
        "data": {"n_train": 48, "n_eval": 16},
        "model": {
            "tiny": {"vocab_size": 400, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512},
            "lora": {"r": 4, "alpha": 8},
        },
        "pretrain": {"records": 0},  # random base weights: SFT alone teaches the tiny model the format
        # Enough SFT for the answer format, so some GRPO groups have reward variance to learn from.
        "sft": {"epochs": 8, "batch_size": 8, "lr": 0.005},
        "grpo": {"steps": 4, "prompts_per_step": 4, "group_size": 2, "sampling": {"max_new_tokens": 6},
                 "multitask": {"mode": "cagrad"},
                 # 2 validation records of each kind, scored at steps 2 and 4: selection runs, cheaply.
                 "selection": {"records": 8, "every": 2}},
        "monitor": {rule: {**DEFAULT_MONITOR[rule], "action": "warn"} for rule in WARN_ONLY_RULES},
        "checkpoint": {"every": 1, "keep_last": 10},
        "tracking": {"wandb": "offline"},
    }
    return merge(tree, overrides)


def merge(tree: dict, overrides: dict) -> dict:
    out = copy.deepcopy(tree)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def write_params(root: Path, tree: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def run_stages(params: Path, *stages: str) -> None:
    for stage in stages:
        code = grpo_main([stage, "--params", str(params)])
        assert code == 0, f"grpo {stage} exited {code}"


def prepared_project(root: Path, **overrides) -> Path:
    """Data, base model, SFT and a passing pre-flight under ``root``; returns the params path."""
    params = write_params(root, tiny_params(root, **overrides))
    run_stages(params, "prepare", "validate", "base", "sft", "preflight")
    return params


def copy_prepared(params: Path, dest: Path) -> Path:
    """A copy of the prepared project whose params point at the copy."""
    shutil.copytree(params.parent, dest)
    text = (dest / "params.yaml").read_text().replace(str(params.parent), str(dest))
    (dest / "params.yaml").write_text(text)
    return dest / "params.yaml"
