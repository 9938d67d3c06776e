"""The GRPO policy as the trainer and the pre-flight gate build it: the SFT weights with a LoRA adapter
(the reference is the same model with the adapter disabled, I9), or every weight trainable with a frozen
copy of the SFT model as the reference. One builder, so the gate checks exactly what trains.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.model.lora import wrap_lora
from grpo.model.precision import apply_memory_settings
from grpo.model.stage_models import load_sft


@dataclass
class Policy:
    """What the loop mutates: the policy model and its optimizer state, and the fixed reference."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: torch.nn.Module | None
    """A frozen copy of the SFT model (full fine-tuning), or None: the policy with its adapter disabled."""


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that no optimizer sees and no gradient reaches (the full fine-tuning reference)."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def build_policy(
    cfg: Config, device: torch.device, shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None
) -> Policy:
    """The policy on the SFT weights: a LoRA adapter (``model.lora.enabled``; every process draws the
    same adapter init from ``cfg.seed``), or all weights with a frozen SFT copy as the reference (I9).
    ``shard``: applied to the policy (not the reference copy) before the optimizer takes its
    parameters (FSDP2, ``grpo/train/sharding.py``)."""
    model, tokenizer = load_sft(cfg)
    apply_memory_settings(model, cfg.model)
    reference = None
    if cfg.model.lora.enabled:
        torch.manual_seed(cfg.seed)
        model = wrap_lora(model, cfg.model.lora)
    elif cfg.grpo.loss.beta > 0:
        reference = frozen_copy(model).to(device)
    # The update runs in train mode (LoRA's wrap leaves it so; a loaded model is in eval mode): gradient
    # checkpointing and dropout act only there. The rollout switches to eval mode and back.
    model = model.to(device).train()
    if shard is not None:
        model = shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.grpo.lr, weight_decay=0.0)
    warmup = cfg.grpo.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return Policy(model, tokenizer, optimizer, scheduler, reference)
