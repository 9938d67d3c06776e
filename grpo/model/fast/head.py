"""The LM head's fp32 product through oneDNN, for ``F.linear(hidden, weight, bias)`` on a CPU.

``F.linear`` multiplies fp32 on a CPU with MKL's sgemm, which runs a vocabulary-wide product of a few
rows well below the cores' fp32 rate; oneDNN's fp32 matmul (PyTorch's private
``torch.ops.mkldnn._linear_pointwise``) computes the same product faster from a head of
``ONEDNN_MIN_WEIGHTS`` weights up. Both accumulate in fp32, in different orders: the logits differ in the
last bits (about 1e-6 of their scale), never by a bf16 rounding, so this path is exact to fp32 rounding,
not bit for bit. A row's logits do not depend on the other rows of the batch once it has two or more
(``tests/test_precision_head.py``). The choice depends on the weight alone, so every pass of a model runs the
same kernel. oneDNN's kernel has no autograd: with gradients, ``precision.Fp32Head`` runs it inside its own
autograd function.

Self-check (``onednn_mismatch``, once per process): the private op exists, takes these arguments and
gives ``F.linear``'s product within fp32 rounding on a probe; where it does not (a PyTorch whose op
changed), the head is ``F.linear`` with a warning.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from grpo.model.fast.warning import fall_back

ONEDNN_MIN_WEIGHTS = 1 << 20
"""Weights (``V x H``) from which the head multiplies through oneDNN: below it oneDNN's fixed cost per call
is the larger part of the product (the embedded model's head has 77k weights, and stays ``F.linear``)."""


def onednn_product(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these tensors suit oneDNN's product: fp32 on a CPU, a head of at least ``ONEDNN_MIN_WEIGHTS``
    weights, and this PyTorch's oneDNN linear kernel present and on."""
    return (
        hidden.device.type == "cpu"
        and hidden.dtype == weight.dtype == torch.float32
        and weight.numel() >= ONEDNN_MIN_WEIGHTS
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def fp32_product(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool
) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` of fp32 tensors; through oneDNN's fp32 matmul where ``onednn``
    (``FastPaths.head_onednn``)."""
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(hidden, weight, bias, "none", [], "")
    return F.linear(hidden, weight, bias)


@functools.cache
def onednn_mismatch() -> str | None:
    """``None`` where oneDNN's product gives ``F.linear``'s within fp32 rounding on a probe head of
    ``ONEDNN_MIN_WEIGHTS`` weights; else why not, with a warning where the op exists but fails (once per
    process). Drawn from its own generator: the global stream is untouched."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(ONEDNN_MIN_WEIGHTS // 256, 256, generator=gen) * 0.05
    hidden, bias = torch.randn(4, 256, generator=gen), torch.randn(weight.shape[0], generator=gen)
    if not onednn_product(hidden, weight):
        return "this PyTorch has no oneDNN linear kernel, or it is off"
    try:
        got = fp32_product(hidden, weight, bias, onednn=True)
        same = torch.allclose(got, F.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)
        reason = None if same else "it no longer gives F.linear's product within fp32 rounding"
    except (RuntimeError, TypeError) as exc:  # the private op's signature moved
        reason = f"it failed ({exc})"
    if reason is not None:
        reason = f"torch.ops.mkldnn._linear_pointwise: {reason}"
        fall_back("oneDNN head product", reason, "F.linear")
    return reason
