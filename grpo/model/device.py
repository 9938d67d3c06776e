"""The one device and precision path: SFT, GRPO, evaluation and the checks all place models and
batches through here.

``accelerate`` decides the device (the process's GPU when there is one, else the CPU); the precision
is the stage's own (``precision.bf16_autocast``: bf16 over fp32 master weights where it pays),
so SFT (``sft.bf16``) and GRPO (``grpo.bf16``) may differ even in one process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from accelerate import Accelerator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
NEVER = -1  # as M_TRIM_THRESHOLD's value: never hand freed heap back (mallopt(3))


def make_accelerator() -> Accelerator:
    """The process's ``Accelerator``: its GPU if present, else the CPU (precision: ``precision.bf16_autocast``),
    where the C allocator then keeps the memory a step frees for the next (``retain_freed_memory``)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        retain_freed_memory()
    return Accelerator(cpu=not on_gpu)


def retain_freed_memory(mmap_below: int = 256 << 20, trim_above: int = NEVER) -> bool:
    """Have glibc's malloc serve blocks below ``mmap_below`` bytes from its heap, and keep the freed heap
    (up to ``trim_above`` bytes of it; by default all), instead of mapping large blocks fresh and returning
    freed memory to the system. A CPU training step allocates and frees the same activations every step;
    by default each of them is memory the kernel must fault in page by page again (the keys, values and
    activations of a kept prefill, live across the step, make it a visible share of a GRPO step). A finite ``trim_above`` is not enough: whenever the free top of the heap passes
    it, glibc hands back all of it at once, and a step whose peak and trough differ by more (SmolLM2's
    update frees several 200 MB logit tensors together) faults in those gigabytes again every step.
    The memory stays the process's, so its resident size is the peak of a step.
    Returns False (and changes nothing) where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_below)) and bool(mallopt(M_TRIM_THRESHOLD, trim_above))


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live."""
    return next(model.parameters()).device


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``device`` (a no-op for those already there)."""
    return tuple(tensor.to(device) for tensor in tensors)
