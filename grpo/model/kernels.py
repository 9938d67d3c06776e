"""``sdpa_grouped``: the ``sdpa`` attention of Hugging Face models, without copying grouped key/value
heads on CPU, and in fp32 under CPU autocast.

With grouped-query attention (Llama-3, Qwen2.5 and the embedded model all have fewer key/value heads
than query heads) and an attention mask, Hugging Face's ``sdpa`` repeats every key and value head
for each query head it serves before calling ``scaled_dot_product_attention``, because on CUDA a
mask with ``enable_gqa`` falls back to the slow math kernel. On CPU the kernel takes ``enable_gqa``
with a mask, so the repeat is a pure copy: of the whole key/value cache, per layer, at every
generated token. ``sdpa_grouped`` passes ``enable_gqa=True`` there instead; the outputs are those of
the repeat (``tests/test_kernels.py``: logits equal, gradients within fp32 rounding). On other
devices, without a mask or without grouping, it is ``sdpa`` itself. ``model.attn_implementation:
sdpa`` loads models with it (``eager`` loads the library's eager attention).

Under CPU bf16 autocast the kernel runs in fp32 (its output in bf16, as autocast's would be), grouped
or not, with a mask or without (autocast alone would run ``sdpa`` in bf16). A precision rule of the
project, not a fast path (it holds under ``model.fast_paths: off``): the queries and keys arrive in fp32
anyway (the rotary embedding computes in the residual stream's dtype), PyTorch's CPU flash-attention
backward is much slower in bf16 than in fp32, and every pass (decode, prefill, reference, update) runs
the same kernel in the same precision.

On CUDA the kernel runs ``scaled_dot_product_attention`` on its flash, memory-efficient or math backend,
never on cuDNN's (``attention_backends``), also a rule of the project rather than a fast path. cuDNN's
attention builds a plan on the host for every new shape, and the shapes of a GRPO step change with every
batch's prompt width, so a host-bound training phase pays that planning again and again (the profile that
showed it: docs/experiments/gpu.md). The other backends plan nothing; under the project's masks (padding,
so flash does not apply) the memory-efficient one runs.

After each attention the kernel lets ``fast.watch_attention`` look (evaluation's reuse of its greedy
pass, ``grpo/model/fast/prompt_pass.py``); outside its watch that is a no-op.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grpo.model.fast import watch_attention

GROUPED_SDPA = "sdpa_grouped"
CUDA_BACKENDS: tuple[SDPBackend, ...] | None = (
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
)
"""The backends ``scaled_dot_product_attention`` may choose from on CUDA, in PyTorch's order of preference:
all but cuDNN's (the module docstring). ``None``: every backend, the library's default choice."""


def attention_backends(device_type: str) -> contextlib.AbstractContextManager:
    """The block's ``scaled_dot_product_attention`` calls on ``device_type`` restricted to ``CUDA_BACKENDS``
    on CUDA; elsewhere (and with ``CUDA_BACKENDS`` None) nothing changes."""
    if device_type != "cuda" or CUDA_BACKENDS is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(CUDA_BACKENDS))


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
    watch_attention(
        out, query, key, value, attention_mask,
        lambda q, k, v, mask: _attend(module, q, k, v, mask, dropout, scaling, is_causal, **kwargs),
    )
    return out, None


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs) -> torch.Tensor:
    """The attention itself (the module docstring says how) -> [B, Q, H, D]. Under CPU autocast every case
    attends in fp32: grouped heads with a mask through ``enable_gqa``, the others (a model without grouped
    heads, a pass without a mask) through ``sdpa`` itself on fp32 inputs."""
    autocast = query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    with (torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext(),
          attention_backends(query.device.type)):
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
