"""Precision and memory settings of the training path: bf16 autocast, SDPA, gradient checkpointing.

The choice: **fp32 master weights and optimizer state, bf16 autocast for the forward pass** on CUDA
and on CPUs with native bf16 matrix instructions (AVX512-BF16 or AMX), when ``sft.bf16`` /
``grpo.bf16`` ask for it. Matmuls run in bf16 on the tensor cores, while the weights, Adam's
moments and every update stay fp32, so small LoRA/AdamW updates are not rounded away (bf16 keeps 8
mantissa bits: an update below 1/256 of a weight vanishes). Log-probs, losses and the KL are taken in
fp32 after the autocast region (``.float()`` in the step). ``model.dtype: bfloat16`` instead loads
bf16 weights, which halves memory but rounds every update; keep it for inference-only stages.

On a CPU without them autocast stays off: bf16 would be emulated, slower than fp32 (``force`` runs
the bf16 code path anyway, which the tests use on any machine).

The project applies autocast itself (``bf16_autocast``), not through accelerate's ``mixed_precision``:
accelerate fixes one precision per process, which would forbid SFT and GRPO (or a check and the
stage it checks) from choosing theirs in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from grpo.config import ModelConfig
from grpo.model.fast import FastPaths, fp32_product


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model``'s output projection (``get_output_embeddings``), or ``None`` where it has none."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if get_head is not None else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def autocast_enabled(device: torch.device, bf16: bool) -> bool:
    """bf16 autocast where it pays: on CUDA, and on a CPU with native bf16 (else emulated: slower)."""
    return bf16 and (device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()))


def bf16_autocast(device: torch.device, bf16: bool, force: bool = False) -> contextlib.AbstractContextManager:
    """Autocast to bf16 for the forward pass where ``autocast_enabled`` (or ``force``), else a no-op."""
    if not (force or autocast_enabled(device, bf16)):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def cast_frozen_weights_once(model: torch.nn.Module) -> Iterator[None]:
    """Inside a CPU autocast region, let autocast cast each frozen weight to bf16 once, not per call.

    Autocast caches its bf16 copy of a weight only for leaves that require grad; the frozen weights
    (LoRA's base, the reference) are cast again at every forward, which in a decode loop of a few
    rows per step is a cost of the size of the matmuls themselves. For the span of the block (run it
    under ``torch.no_grad``, as generation is: no graph is built) the frozen floating-point weights
    are marked as requiring grad, so each is cast once; the flags are restored on exit. The values
    are those autocast computes anyway (the same rounding of the same fp32 weight). CPU only: on a
    GPU the cast is cheap and the cached copy would cost memory.
    """
    frozen = (
        [
            p
            for p in model.parameters()
            if not p.requires_grad and p.is_floating_point() and p.device.type == "cpu"
        ]
        if torch.is_autocast_enabled("cpu")
        else []
    )
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


@contextlib.contextmanager
def frozen_linears_in_bf16(models: list[torch.nn.Module], on: bool) -> Iterator[None]:
    """For the span of the block, hold the frozen ``nn.Linear`` weights (and biases) of ``models`` in bf16.

    Under CPU bf16 autocast every ``F.linear`` casts its fp32 weight to bf16 at each call: a GRPO step
    casts the frozen base about six times (the kept prefill, the reference's passes, the update's
    forward; the decode loop once). Autocast rounds to nearest, as ``.to(bfloat16)`` does, so a weight
    held in bf16 gives the very bf16 operand autocast would have made: the same matmuls, bit for bit,
    cast once. Only plain ``nn.Linear`` modules: the output head (``Fp32Head``, fp32 by design), norms
    and embeddings keep their fp32 weights, and trainable weights (LoRA's, or every weight in full
    fine-tuning) are never touched. The fp32 tensors are put back on exit, so a checkpoint or a save
    after the block writes them. ``on`` False: a no-op (no autocast, a GPU, sharded or replicated
    weights)."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    if on:
        for model in models:
            head = output_head(model)
            for module in model.modules():
                if type(module) is not torch.nn.Linear or module is head:
                    continue
                for param in (module.weight, module.bias):
                    if param is not None and not param.requires_grad and param.dtype == torch.float32:
                        swapped.append((param, param.data))
                        param.data = param.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for param, data in swapped:
            param.data = data


class _HeadProduct(torch.autograd.Function):
    """``fast.fp32_product(hidden, weight, bias, onednn)``, its backward's two products in ``low``
    (autocast's dtype under autocast, else fp32: then the products of ``F.linear``'s own backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, low, onednn):
        ctx.save_for_backward(hidden, weight)
        ctx.low = low
        return fp32_product(hidden, weight, bias, onednn)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad_low = grad.to(ctx.low)  # [..., V]
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_low.reshape(-1, grad_low.shape[-1]) @ weight.to(ctx.low)).to(hidden.dtype)
            grad_hidden = grad_hidden.reshape(hidden.shape)  # [..., H]
        if ctx.needs_input_grad[1]:
            rows = grad_low.reshape(-1, grad_low.shape[-1])
            grad_weight = (rows.T @ hidden.reshape(-1, hidden.shape[-1]).to(ctx.low)).to(weight.dtype)  # [V, H]
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(dim=0)
        return grad_hidden, grad_weight, grad_bias, None, None


class Fp32Head(torch.nn.Linear):
    """The LM head computed in fp32 whatever the autocast: the product of the fp32 hidden states and the
    fp32 weights (cast per call when the model holds bf16 weights; ``fast.fp32_product``: a large head's
    through oneDNN on a CPU where ``model.fast_paths`` allows), so logits, log-softmax and entropy carry fp32
    digits. Under bf16 autocast a bf16 head rounds every logit to 8 mantissa bits: at logits of a few tens
    two scorings of the same ids can differ by tenths of a nat, more than the clip range of the ratio (the fix TRL's
    ``cast_lm_head_to_fp32`` and MiniMax-M1, arXiv 2506.13585, apply). The body keeps its bf16 matmuls:
    only the head's ``V x H`` product runs in fp32.

    The backward runs at the body's precision: under autocast the gradients of the hidden states (and of
    a trainable head's weights) are products in autocast's dtype, as every other layer's backward is,
    from the fp32 gradient of the fp32 logits; without autocast they are fp32 products. Forward numbers
    are the same either way; the backward's fp32 ``[N, V] x [V, H]`` product would be the update's
    largest matmul, and the gradient enters the body's bf16 backward next anyway. This backward is a
    precision rule, not a fast path: it holds under ``model.fast_paths: off`` too."""

    fast_paths: FastPaths = FastPaths("auto")
    """Whether the product may run through oneDNN (``fp32_head``'s ``fast_paths``, ``model.fast_paths``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kind = hidden.device.type
        low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        with torch.autocast(device_type=kind, enabled=False):
            hidden, weight = hidden.float(), self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            onednn = self.fast_paths.head_onednn(hidden, weight)
            tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
            if tracked and (low is not None or onednn):
                return _HeadProduct.apply(hidden, weight, bias, low or torch.float32, onednn)
            return fp32_product(hidden, weight, bias, onednn)  # F.linear's own autograd where it is F.linear


def fp32_head(model: torch.nn.Module, fast_paths: FastPaths | None = None) -> torch.nn.Module:
    """Make ``model``'s output projection an ``Fp32Head`` (the same parameters, tied ones included; the
    state dict's names are unchanged), whose product follows ``fast_paths`` (the run's ``model.fast_paths``;
    ``None``: ``auto``). Models whose head is not a plain ``nn.Linear`` are left alone."""
    head = output_head(model)
    if type(head) is torch.nn.Linear:
        head.__class__ = Fp32Head
    if isinstance(head, Fp32Head) and fast_paths is not None:
        head.fast_paths = fast_paths
    return model


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
    return (
        f"weights {str(weights).removeprefix('torch.')}, compute {compute}, attention {attention}, "
        f"gradient checkpointing {'on' if checkpointing else 'off'}, device {device}"
    )
