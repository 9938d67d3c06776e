"""LoRA: GRPO's adapter on the SFT weights (peft), and the reference as that model with the adapter off (I9)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import PreTrainedModel

from grpo.config import LoraConfig


def wrap_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel:
    """Add a LoRA adapter with peft; only the adapter weights stay trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    missing = [
        name for name in cfg.target_modules if not any(n.endswith(name) for n, _ in model.named_modules())
    ]
    if missing:
        raise ValueError(
            f"model.lora.target_modules: {missing} match no module of {type(model).__name__}; "
            "use names such as q_proj, k_proj, v_proj, o_proj"
        )
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """``model`` with every LoRA layer off, as PEFT's ``disable_adapter`` turns them off (each tuner
    layer's ``disable_adapters`` flag, which makes its forward the base layer's), without that
    context's survey of the whole model's adapter status and trainable parameters on every entry (a
    walk over every module and parameter; on the tiny model it cost as much as the reference forward).
    Each layer's flag is restored as it was."""
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer._disable_adapters = was
