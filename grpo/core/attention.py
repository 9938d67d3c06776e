"""The attention mask handed to the model, prepared once per call instead of by the model.

Given a 2D padding mask, a Hugging Face model builds its 4D attention mask on every forward
(``masking_utils.create_causal_mask``); on CPU that is a chain of vmapped Python closures which, for
a small model, can cost as much as the forward itself, and a decode loop pays it at every token. A 4D mask passed in is used as given, so this module builds the same mask with
two tensor ops: key ``k`` is visible to query ``q`` when ``k`` is a real token and not after ``q``.
The values equal the model's own mask (``tests/test_attention.py`` compares logits with the 2D path),
so the numbers do not change. Models where a 2D mask means more than causal + padding (a sliding
window) or whose attention takes no 4D mask (flash attention) get the 2D mask unchanged.
"""

from __future__ import annotations

import torch

SDPA_IMPLEMENTATIONS = ("sdpa", "sdpa_grouped")  # sdpa_grouped: grpo/model/kernels.py
PREPARED_IMPLEMENTATIONS = (*SDPA_IMPLEMENTATIONS, "eager")


def takes_prepared_mask(model: torch.nn.Module) -> bool:
    """Whether ``model`` reads a 4D mask that is exactly causal + padding (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    return (
        getattr(config, "_attn_implementation", None) in PREPARED_IMPLEMENTATIONS
        and not window
        and all(kind == "full_attention" for kind in layer_types)
    )


def causal_padding_mask(attention_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """attention_mask: [B, K] 1 = real token, the queries being its last ``query_length`` columns ->
    [B, 1, Q, K] bool, True where query ``q`` may attend key ``k`` (k real and k <= q's column)."""
    keys = attention_mask.shape[1]
    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, K]
    if query_length == 1:
        return real
    causal = torch.ones(query_length, keys, dtype=torch.bool, device=attention_mask.device)
    return real & causal.tril(keys - query_length)  # [B, 1, Q, K]


def model_attention_mask(
    model: torch.nn.Module, attention_mask: torch.Tensor, query_length: int
) -> torch.Tensor:
    """The mask to pass as ``attention_mask=``: 4D and prepared where ``takes_prepared_mask``, else the
    2D mask unchanged. sdpa reads a boolean mask; eager adds it to the scores, so it gets 0 where
    visible and the dtype's minimum elsewhere, as the model's own eager mask."""
    if not takes_prepared_mask(model):
        return attention_mask
    mask = causal_padding_mask(attention_mask, query_length)
    if model.config._attn_implementation in SDPA_IMPLEMENTATIONS:
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )
