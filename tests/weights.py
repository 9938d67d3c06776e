"""Seeded weights for tests whose outcome must depend on the input: at its init scale the tiny model
answers every prompt with one repeated token, which would let a wrong mask or extraction pass."""

from __future__ import annotations

import torch


def spread_weights(model: torch.nn.Module, generator: torch.Generator, scale: float = 0.3) -> torch.nn.Module:
    """Every matrix of ``model`` redrawn from N(0, scale²) with ``generator``."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def fill_adapter(policy: torch.nn.Module, generator: torch.Generator, std: float = 0.3) -> torch.nn.Module:
    """A LoRA adapter that changes the model: every ``lora_B`` (zero at init) drawn from N(0, std²)."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std, generator=generator)
    return policy
