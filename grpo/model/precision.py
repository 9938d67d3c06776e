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
import warnings
from collections.abc import Iterator
from typing import NamedTuple

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

    Under bf16 autocast every ``F.linear`` casts its fp32 weight to bf16 at each call: a GRPO step
    casts the frozen base about six times (the kept prefill, the reference's passes, the update's
    forward; the decode loop once on a CPU, at every token on a GPU). Autocast rounds to nearest, as ``.to(bfloat16)`` does, so a weight
    held in bf16 gives the very bf16 operand autocast would have made: the same matmuls, bit for bit,
    cast once. Only plain ``nn.Linear`` modules: the output head (``Fp32Head``, fp32 by design), norms
    and embeddings keep their fp32 weights, and trainable weights (LoRA's, or every weight in full
    fine-tuning) are never touched. The fp32 tensors are put back on exit, so a checkpoint or a save
    after the block writes them. On a GPU the bf16 copies take half the frozen weights' memory for the step,
    which the autocast casts an update's forward keeps for its backward took anyway. ``on`` False: a no-op
    (no autocast, sharded or replicated weights)."""
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


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` as two bf16 parts, ``x ~ hi + lo``: ``hi = bf16(x)``, ``lo = bf16(x - hi)`` (the residual is
    exact in fp32), about 16 of fp32's 24 mantissa bits."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def split_product(
    hidden: tuple[torch.Tensor, torch.Tensor],  # [n, H] each: split_bf16 of the hidden states
    weight: tuple[torch.Tensor, torch.Tensor],  # [V, H] each: split_bf16 of the weight
    matmul,  # (a [n, H] bf16, b [H, V] bf16) -> [n, V] fp32, the products accumulated in fp32
) -> torch.Tensor:
    """The "bf16x3" product ``hi@hi + hi@lo + lo@hi`` -> [n, V] fp32 (``lo@lo``, at most 2^-16 of a term,
    dropped). A product of two bf16 numbers is exact in fp32, so each term of the sum carries about 16
    mantissa bits of its operands (off by at most about 2^-15 of ``|h w|``, where a bf16 product is off by up
    to 2^-8), and the terms are accumulated and returned in fp32."""
    (h_hi, h_lo), (w_hi, w_lo) = hidden, weight
    logits = matmul(h_hi, w_hi.T)
    logits += matmul(h_hi, w_lo.T)
    logits += matmul(h_lo, w_hi.T)
    return logits


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


_SPLIT_PRODUCT: dict[str, bool] = {}
"""Whether ``torch.mm(bf16, bf16, out_dtype=float32)`` runs, by device type (checked once)."""


def split_product_available(device: torch.device) -> bool:
    """Whether this PyTorch multiplies bf16 matrices into fp32 on ``device`` (CUDA only): else the head's
    scoring product falls back to fp32, with one warning."""
    if device.type != "cuda":
        return False
    if device.type not in _SPLIT_PRODUCT:
        try:
            one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
            _SPLIT_PRODUCT[device.type] = _mm_fp32_out(one, one).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError) as error:
            _SPLIT_PRODUCT[device.type] = False
            warnings.warn(
                f"torch {torch.__version__} has no torch.mm(bf16, bf16, out_dtype=float32) on {device.type} "
                f"({error}): the LM head's scoring product runs in fp32 on the CUDA cores, slower than the "
                "bf16x3 product, at fp32 precision",
                stacklevel=2,
            )
    return _SPLIT_PRODUCT[device.type]


class Fp32Product(NamedTuple):
    """``fp32_product`` (oneDNN's for a large head on a CPU where ``onednn``), the backward's products in
    ``low_weight``'s dtype."""

    weight: torch.Tensor  # [V, H] fp32
    bias: torch.Tensor | None
    low_weight: torch.Tensor  # [V, H]
    onednn: bool = False

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return fp32_product(hidden, self.weight, self.bias, self.onednn)


class SplitProduct(NamedTuple):
    """``split_product`` on CUDA's bf16 tensor cores; its ``hi`` part is the bf16 weight of the backward."""

    weight: tuple[torch.Tensor, torch.Tensor]  # split_bf16 of the [V, H] weight
    bias: torch.Tensor | None

    @property
    def low_weight(self) -> torch.Tensor:
        return self.weight[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = split_product(split_bf16(hidden), self.weight, _mm_fp32_out)
        return logits if self.bias is None else logits + self.bias


def head_product(
    weight: torch.Tensor, bias: torch.Tensor | None, low: torch.dtype, onednn: bool = False
) -> Fp32Product | SplitProduct:
    """The scoring product of an fp32 head whose backward runs in ``low`` (autocast's dtype, else fp32):
    bf16x3 on CUDA under bf16 autocast (fp32 products run on the CUDA cores, at a small fraction of the
    tensor cores' rate), ``fp32_product`` everywhere else (through oneDNN where ``onednn``)."""
    if low == torch.bfloat16 and split_product_available(weight.device):
        return SplitProduct(split_bf16(weight), bias)
    return Fp32Product(weight, bias, weight.to(low), onednn)


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
    precision rule, not a fast path: it holds under ``model.fast_paths: off`` too.

    Scoring (``scores_requests``): while ``score_completions`` has handed it a ``core.head_scores.HeadRequest``,
    the head returns the log-probs and entropy of the requested ids, chunk by chunk, instead of logits
    (``core.head_scores.score_in_head``). Its product is ``head_product``: ``fp32_product`` on a CPU and
    wherever autocast is off; on CUDA under bf16 autocast the split-bf16 "bf16x3" product (``split_product``:
    each operand as two bf16 parts, three tensor-core products accumulated and returned in fp32), about 16
    mantissa bits of each product term, fp32 accumulation and output: the logits are never rounded to bf16.
    Without a request (the rollout's sampling, the readable full-logits path) the product is fp32."""

    scores_requests = True
    head_request = None
    """A ``core.head_scores.HeadRequest`` while ``score_completions`` has handed it one (``head_request``)."""
    fast_paths: FastPaths = FastPaths("auto")
    """Whether the product may run through oneDNN (``fp32_head``'s ``fast_paths``, ``model.fast_paths``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kind = hidden.device.type
        low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if self.head_request is not None:
            return self._scores(hidden, self.head_request, low or torch.float32)
        with torch.autocast(device_type=kind, enabled=False):
            hidden, weight = hidden.float(), self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            onednn = self.fast_paths.head_onednn(hidden, weight)
            tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
            if tracked and (low is not None or onednn):
                return _HeadProduct.apply(hidden, weight, bias, low or torch.float32, onednn)
            return fp32_product(hidden, weight, bias, onednn)  # F.linear's own autograd where it is F.linear

    def _scores(self, hidden: torch.Tensor, request, low: torch.dtype) -> torch.Tensor:
        """``request``'s scores [B, C, 2 or 1] from ``hidden`` [B, C + 1, H], the backward's products in ``low``."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            weight = self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            onednn = self.fast_paths.head_onednn(hidden.float(), weight)
            return request.score(hidden, weight, bias, lambda w, b: head_product(w, b, low, onednn))


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
