"""The one device and precision path: SFT, GRPO, evaluation and the checks all place models and
batches through here.

``accelerate`` decides the device (the process's GPU when there is one, else the CPU) and the
precision (bf16 autocast on GPU when ``grpo.bf16``; accelerate allows one precision per process, so
SFT and GRPO share the setting when ``grpo pipeline`` runs them in one process).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from grpo.config import Config


def make_accelerator(cfg: Config) -> Accelerator:
    """The process's ``Accelerator``: GPU if present, bf16 autocast there when ``grpo.bf16``."""
    cuda = torch.cuda.is_available()
    return Accelerator(cpu=not cuda, mixed_precision="bf16" if cfg.grpo.bf16 and cuda else "no")


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live."""
    return next(model.parameters()).device


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``device`` (a no-op for those already there)."""
    return tuple(tensor.to(device) for tensor in tensors)
