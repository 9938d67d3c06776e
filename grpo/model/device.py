"""The one device and precision path: SFT, GRPO, evaluation and the checks all place models and
batches through here.

``accelerate`` decides the device (the process's GPU when there is one, else the CPU); the precision
is the stage's own (``precision.bf16_autocast``: bf16 over fp32 master weights where it pays),
so SFT (``sft.bf16``) and GRPO (``grpo.bf16``) may differ even in one process.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator


def make_accelerator() -> Accelerator:
    """The process's ``Accelerator``: its GPU if present, else the CPU (precision: ``precision.bf16_autocast``)."""
    return Accelerator(cpu=not torch.cuda.is_available())


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live."""
    return next(model.parameters()).device


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``device`` (a no-op for those already there)."""
    return tuple(tensor.to(device) for tensor in tensors)
