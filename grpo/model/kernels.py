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

Under CPU bf16 autocast the kernel runs in fp32 (its output in bf16, as autocast's would be):
PyTorch's CPU flash-attention backward takes about 8 ms per layer in bf16 against 1.5-2 ms in fp32
at prompt lengths on SmolLM2 (a third of a GRPO update), the forward costs the same, and the
queries and keys arrive in fp32 anyway (the rotary embedding computes in the residual stream's
dtype), so fp32 attention is both faster and more exact. Every pass (decode, prefill, reference,
update) runs the same kernel in the same precision.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "sdpa_grouped"


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
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if query.device.type != "cpu" or attention_mask is None or not grouped:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    if attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    autocast = torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(
            query.float() if autocast else query,
            key.float() if autocast else key,
            value.float() if autocast else value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=False,
            enable_gqa=True,
        )
    if autocast:
        out = out.to(torch.get_autocast_dtype("cpu"))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, sdpa_grouped_forward)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # its 2D -> 4D mask is sdpa's


def attention_kernel(attn_implementation: str) -> str:
    """The implementation to load a model with for ``model.attn_implementation``: ``sdpa`` becomes
    ``sdpa_grouped`` (the same attention), the others stay as named."""
    return GROUPED_SDPA if attn_implementation == "sdpa" else attn_implementation
