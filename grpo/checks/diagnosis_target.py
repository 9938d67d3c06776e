"""What ``grpo diagnose`` diagnoses: the policy in a model, adapter or checkpoint folder, and its reference.

A full model folder (``models/base``, ``models/sft``) is where GRPO would start: a fresh LoRA adapter is
put on it (the reference: the adapter disabled), or with ``model.lora.enabled: false`` its weights are
the policy and a frozen copy the reference. A GRPO adapter folder (``models/grpo``) or checkpoint
(``runs/<experiment>/checkpoint-XXXXXXXX``) is a trained policy on the SFT weights: its reference is the
adapter disabled, or (full fine-tuning: the fully trained ``models/grpo``, or a checkpoint of every
weight) the SFT model loaded apart (I9).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from grpo import paths
from grpo.config import Config
from grpo.errors import GrpoError
from grpo.model.base_model import base_inputs
from grpo.model.device import make_accelerator
from grpo.model.loading import POINTER_FILE, load_model, load_tokenizer
from grpo.model.lora import wrap_lora
from grpo.provenance.lineage import is_stale, read_lineage
from grpo.train import checkpoint as ckpt
from grpo.train.policy import frozen_copy

CHECKPOINT_NAME = re.compile(r"checkpoint-\d{8,}")
"""Folder name ``grpo.train.checkpoint.checkpoint_path`` gives a checkpoint."""
Kind = Literal["model", "adapter", "checkpoint"]


class DiagnoseError(GrpoError):
    """The diagnosis target cannot be recognised or loaded; the message names the path and the fix."""


@dataclass
class Target:
    """The policy under diagnosis and its reference (I9)."""

    model: torch.nn.Module
    tokenizer: Any
    kind: Kind
    path: Path
    fresh: bool
    """True when the policy is where GRPO starts (a full model folder): KL to the reference must be 0."""
    stale: list[str] = field(default_factory=list)
    """Why the target or the SFT weights under it do not match the current code/params (empty: fresh)."""
    reference: torch.nn.Module | None = None
    """The frozen SFT weights (full fine-tuning), or None: ``model`` with its LoRA adapter disabled."""

    @property
    def lora(self) -> bool:
        """Whether the policy trains through a LoRA adapter (else every weight trains)."""
        return self.reference is None


def target_kind(path: Path) -> Kind:
    """``checkpoint`` (``checkpoint-XXXXXXXX``), ``adapter`` (``adapter_config.json``) or ``model``."""
    if CHECKPOINT_NAME.fullmatch(path.name):
        return "checkpoint"
    if (path / "adapter_config.json").is_file():
        return "adapter"
    if (path / "config.json").is_file() or (path / POINTER_FILE).is_file():
        return "model"
    raise DiagnoseError(
        f"grpo diagnose {path}: not a model folder (config.json), a LoRA adapter folder "
        "(adapter_config.json) or a GRPO checkpoint (runs/<experiment>/checkpoint-XXXXXXXX); "
        "pass e.g. models/sft, models/grpo or a checkpoint folder"
    )


def _fresh_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    # Seeded like the trainer's build_policy, without moving the global generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return wrap_lora(model, cfg.model.lora)


def _stale(path: Path, stage: str, cfg: Config, inputs: dict[str, Path]) -> list[str]:
    """Every code, params and input change that makes ``path`` stale, as the lineage error names them."""
    reason = is_stale(path, stage, cfg, inputs)
    if not reason:
        return []
    lines = [
        line.strip().removeprefix("- ") for line in reason.splitlines() if not line.startswith("Rebuild it")
    ]
    return [lines[0].removesuffix(":") + (": " + "; ".join(lines[1:]) if len(lines) > 1 else "")]


def _base_stale(cfg: Config) -> list[str]:
    return _stale(paths.model_dir(cfg, "base"), "base", cfg, base_inputs(cfg))


def _sft_stale(cfg: Config) -> list[str]:
    """The SFT model's changes and its base's (as ``load_sft`` refuses either)."""
    return _base_stale(cfg) + _stale(paths.model_dir(cfg, "sft"), "sft", cfg, paths.stage_inputs(cfg, "sft"))


def _frozen_sft(cfg: Config) -> torch.nn.Module:
    """The SFT weights loaded apart, as the reference of a fully fine-tuned policy (I9)."""
    return load_model(paths.model_dir(cfg, "sft"), cfg.model).requires_grad_(False)


def _model_target(cfg: Config, path: Path) -> Target:
    """A full model folder: a fully fine-tuned GRPO policy (``model.lora.enabled: false``, lineage of
    stage grpo) against the SFT weights, or where GRPO would start (a fresh adapter, or the weights and
    a frozen copy of them)."""
    model, tokenizer = load_model(path, cfg.model), load_tokenizer(path, cfg.model)
    if not cfg.model.lora.enabled and (read_lineage(path) or {}).get("stage") == "grpo":
        stale = _sft_stale(cfg) + _stale(path, "grpo", cfg, paths.stage_inputs(cfg, "grpo"))
        return Target(model, tokenizer, "model", path, fresh=False, stale=stale, reference=_frozen_sft(cfg))
    stage = next(
        (name for name in ("base", "sft") if path.resolve() == paths.model_dir(cfg, name).resolve()), None
    )
    stale = {"base": _base_stale, "sft": _sft_stale}[stage](cfg) if stage else []
    if cfg.model.lora.enabled:
        return Target(_fresh_lora(model, cfg), tokenizer, "model", path, fresh=True, stale=stale)
    return Target(model, tokenizer, "model", path, fresh=True, stale=stale, reference=frozen_copy(model))


def _trained_target(cfg: Config, path: Path, kind: Kind) -> Target:
    """A GRPO adapter folder, or a checkpoint: its trainable weights loaded onto the SFT model (a
    fresh adapter on it, or with ``model.lora.enabled: false`` every weight)."""
    stale = _sft_stale(cfg) + _stale(path, "grpo", cfg, paths.stage_inputs(cfg, "grpo"))
    sft = load_model(paths.model_dir(cfg, "sft"), cfg.model)
    if kind == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(sft, path, is_trainable=True)
        return Target(model, load_tokenizer(path, cfg.model), kind, path, fresh=False, stale=stale)
    full = not cfg.model.lora.enabled
    model = sft if full else _fresh_lora(sft, cfg)
    ckpt.load_checkpoint(path, model=model, optimizer=None, scheduler=None)
    tokenizer = load_tokenizer(paths.model_dir(cfg, "sft"), cfg.model)
    return Target(
        model, tokenizer, kind, path, fresh=False, stale=stale, reference=_frozen_sft(cfg) if full else None
    )


def load_target(cfg: Config, path: str | Path) -> Target:
    """Load the policy to diagnose and its reference, on GPU when there is one, in eval mode (no dropout)."""
    path = Path(path)
    if not path.is_dir():
        raise DiagnoseError(
            f"grpo diagnose {path}: no such folder; pass a model, adapter or checkpoint folder"
        )
    kind = target_kind(path)
    target = _model_target(cfg, path) if kind == "model" else _trained_target(cfg, path, kind)
    device = make_accelerator().device
    target.model.to(device).eval()
    if target.reference is not None:
        target.reference.to(device).eval()
    return target
