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


def make_accelerator(cfg: Config, bf16: bool | None = None) -> Accelerator:
    """The process's ``Accelerator``: GPU if present, bf16 autocast there when ``bf16`` (default
    ``grpo.bf16``; SFT passes ``sft.bf16``: in one process, as ``grpo pipeline`` runs, keep them equal)."""
    cuda = torch.cuda.is_available()
    bf16 = cfg.grpo.bf16 if bf16 is None else bf16
    return Accelerator(cpu=not cuda, mixed_precision="bf16" if bf16 and cuda else "no")


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live."""
    return next(model.parameters()).device


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``device`` (a no-op for those already there)."""
    return tuple(tensor.to(device) for tensor in tensors)
