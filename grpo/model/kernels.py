"""``sdpa_grouped``: the ``sdpa`` attention of Hugging Face models, without copying grouped key/value
heads on CPU.

With grouped-query attention (Llama-3, Qwen2.5 and the embedded model all have fewer key/value heads
than query heads) and an attention mask, Hugging Face's ``sdpa`` repeats every key and value head
for each query head it serves before calling ``scaled_dot_product_attention``, because on CUDA a
mask with ``enable_gqa`` falls back to the slow math kernel. On CPU the kernel takes ``enable_gqa``
with a mask, so the repeat is a pure copy: of the whole key/value cache, per layer, at every
generated token (on the embedded model about a third of a decode step). ``sdpa_grouped`` passes
``enable_gqa=True`` there instead; the outputs are those of the repeat (``tests/test_kernels.py``:
logits equal, gradients within fp32 rounding). On other devices, without a mask or without
grouping, it is ``sdpa`` itself. ``model.attn_implementation: sdpa`` loads models with it.

Under CPU bf16 autocast the kernel runs in fp32 (its output in bf16, as autocast's would be), grouped
or not, with a mask or without (autocast alone would run ``sdpa`` in bf16):
PyTorch's CPU flash-attention backward takes about 8 ms per layer in bf16 against 1.5-2 ms in fp32
at prompt lengths on SmolLM2 (a third of a GRPO update), the forward costs the same, and the
queries and keys arrive in fp32 anyway (the rotary embedding computes in the residual stream's
dtype), so fp32 attention is both faster and more exact. Every pass (decode, prefill, reference,
update) runs the same kernel in the same precision.

``PrefixWatch`` and ``rows_independent`` say when a pass over whole prompts holds, bit for bit, the keys
and values a pass over the same prompts without their last column would compute (evaluation's samples
then reuse its greedy pass: ``decode.PromptPass``). The linear layers compute each row alone on CPU, but
the CPU flash kernel splits the queries into blocks, and the blocks among threads, by the lengths, so at
some widths a query's attention output moves in its last bits when the sequence is one column shorter:
the watch runs each layer's attention over the shortened prompts too and compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grpo.model.precision import output_head

GROUPED_SDPA = "sdpa_grouped"


class PrefixWatch:
    """Filled by a forward pass run inside ``watch_prefix``: how many attention calls over whole sequences
    (queries as long as the keys) it saw, and whether each gave, for every query but the last, the outputs
    of the same call on the sequences without their last column."""

    def __init__(self) -> None:
        self.calls = 0
        self.equal = True


_WATCH: ContextVar[PrefixWatch | None] = ContextVar("prefix_watch", default=None)


@contextlib.contextmanager
def watch_prefix(watch: PrefixWatch) -> Iterator[PrefixWatch]:
    """Let ``sdpa_grouped_forward`` check ``watch``'s claim for the passes run inside the block."""
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)


def sdpa_grouped_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, K, D]
    value: torch.Tensor,  # [B, H_kv, K, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, K] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """-> ([B, Q, H, D], None), as ``sdpa_attention_forward``."""
    out = _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    watch = _WATCH.get()
    if watch is not None and query.shape[-2] == key.shape[-2] > 1:
        watch.calls += 1
        if attention_mask is None or attention_mask.ndim != 4:  # the shorter pass's mask is not a slice of this one
            watch.equal = False
        elif watch.equal:
            mask = attention_mask[:, :, :-1, : key.shape[-2] - 1]
            shorter = _attend(
                module, query[..., :-1, :], key[..., :-1, :], value[..., :-1, :], mask, dropout, scaling, is_causal,
                **kwargs,
            )
            watch.equal = torch.equal(out[:, :-1], shorter)
    return out, None


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs) -> torch.Tensor:
    """The attention itself (the module docstring says how) -> [B, Q, H, D]. Under CPU autocast every case
    attends in fp32: grouped heads with a mask through ``enable_gqa``, the others (a model without grouped
    heads, a pass without a mask) through ``sdpa`` itself on fp32 inputs."""
    autocast = query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
        if autocast:
            query, key, value = query.float(), key.float(), value.float()
        if query.device.type != "cpu" or attention_mask is None or not grouped:
            out = sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                **kwargs,
            )[0]  # [B, Q, H, D]
            return out.to(torch.get_autocast_dtype("cpu")) if autocast else out
        if attention_mask.ndim == 4:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False,
            enable_gqa=True,
        )  # [B, H, Q, D]
    if autocast:
        out = out.to(torch.get_autocast_dtype("cpu"))
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(GROUPED_SDPA, sdpa_grouped_forward)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # its 2D -> 4D mask is sdpa's


def attention_kernel(attn_implementation: str) -> str:
    """The implementation to load a model with for ``model.attn_implementation``: ``sdpa`` becomes
    ``sdpa_grouped`` (the same attention), the others stay as named."""
    return GROUPED_SDPA if attn_implementation == "sdpa" else attn_implementation


_INDEPENDENT: dict[tuple, bool] = {}


def rows_independent(model: torch.nn.Module, rows: int, fewer: int) -> bool:
    """Whether every linear layer of ``model`` but its output head, under the autocast in force, gives the
    first ``fewer`` rows of a ``rows``-row product exactly as a product of those rows alone. A matmul kernel
    picks its blocking by shape: CPU bf16 products and fp32 ones of a dozen rows or more compute each row
    alone, while fp32 products of a few rows take other kernels. Tried once per layer class, weight shape
    and row counts, on random rows (the kernel's choice depends on the shapes, not the values)."""
    head = output_head(model)
    linears = {}
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear) and layer is not head:
            kind = (type(layer), tuple(layer.weight.shape), layer.weight.dtype, layer.bias is not None)
            linears.setdefault(kind, layer)
    device = next(model.parameters()).device
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    for kind, layer in linears.items():
        key = (*kind, rows, fewer, device.type, autocast)
        if key not in _INDEPENDENT:
            gen = torch.Generator(device=device).manual_seed(0)
            hidden = torch.randn(rows, kind[1][1], generator=gen, device=device).to(kind[2])
            with torch.no_grad():
                _INDEPENDENT[key] = torch.equal(layer(hidden)[:fewer], layer(hidden[:fewer]))
        if not _INDEPENDENT[key]:
            return False
    return True
