"""Precision and memory settings of the training path: bf16 autocast, SDPA, gradient checkpointing.

The choice: **fp32 master weights and optimizer state, bf16 autocast for the forward pass** on CUDA
(``sft.bf16``, ``grpo.bf16``). Matmuls run in bf16 on the tensor cores, while the weights, Adam's
moments and every update stay fp32, so small LoRA/AdamW updates are not rounded away (bf16 keeps 8
mantissa bits: an update below 1/256 of a weight vanishes). Log-probs, losses and the KL are taken in
fp32 after the autocast region (``.float()`` in the step). ``model.dtype: bfloat16`` instead loads
bf16 weights, which halves memory but rounds every update; keep it for inference-only stages.

On CPU autocast is off (``bf16_autocast`` returns a no-op unless ``force`` is set, which the tests use
to run the bf16 code path without a GPU).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from grpo.config import ModelConfig


def autocast_enabled(device: torch.device, bf16: bool) -> bool:
    """bf16 autocast runs on CUDA only: on CPU it is slower than fp32 and gains no memory."""
    return bf16 and device.type == "cuda"


def bf16_autocast(device: torch.device, bf16: bool, force: bool = False) -> contextlib.AbstractContextManager:
    """Autocast to bf16 for the forward pass where ``autocast_enabled`` (or ``force``), else a no-op."""
    if not (force or autocast_enabled(device, bf16)):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def apply_memory_settings(model: PreTrainedModel, cfg: ModelConfig) -> PreTrainedModel:
    """Turn on gradient checkpointing when ``model.gradient_checkpointing`` (before any LoRA wrap).

    Non-reentrant checkpointing (PyTorch's recommended mode): gradients reach a LoRA adapter on frozen
    weights without making the inputs require grad, and the recomputation replays the same RNG state
    (dropout draws the same masks), so the gradients equal those without checkpointing.
    """
    if cfg.gradient_checkpointing:
        # The config's use_cache stays as it is: it is saved with the model, and rollouts ask for the cache.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def describe(model: PreTrainedModel, device: torch.device, bf16: bool) -> str:
    """One line for the logs: weight dtype, compute dtype, attention kernel, checkpointing."""
    weights = next(model.parameters()).dtype
    compute = "bf16 autocast" if autocast_enabled(device, bf16) else str(weights).removeprefix("torch.")
    attention = getattr(model.config, "_attn_implementation", "?")
    checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return (f"weights {str(weights).removeprefix('torch.')}, compute {compute}, attention {attention}, "
            f"gradient checkpointing {'on' if checkpointing else 'off'}, device {device}")
