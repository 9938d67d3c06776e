"""Evaluation's samples start from its greedy pass, for the samples' own prefill (``prefix.prefilled_cache``).

Evaluation decodes each batch's prompts greedily, then samples them: the samples' prefill of every prompt
column but the last would run the same prompts through the same weights again. ``PromptPass`` keeps the
greedy pass's keys and values and offers their first columns as the samples' cache, only where they are
that prefill's numbers bit for bit:

- ``PrefixWatch`` (filled by ``watch_attention``, which the attention kernel calls): the CPU flash kernel
  splits the queries into blocks, and the blocks among threads, by the lengths, so at some widths a
  query's attention output moves in its last bits when the sequence is one column shorter; the watch runs
  each layer's attention over the shortened prompts too and compares.
- ``rows_independent``: the linear layers compute each row alone at both row counts (a matmul kernel
  picks its blocking by shape).

Where either says no, the samples run their own prefill (the library's path); the replies and numbers
are the same either way (``tests/test_decode.py``, ``tests/test_evaluate.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from transformers import PreTrainedModel


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
    """Let ``watch_attention`` check ``watch``'s claim for the passes run inside the block."""
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)


def watch_attention(
    out: torch.Tensor,  # [B, Q, H, D] the attention's output
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, K, D]
    value: torch.Tensor,  # [B, H_kv, K, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, K] or None
    attend: Callable[..., torch.Tensor],  # (query, key, value, attention_mask) -> [B, Q, H, D]
) -> None:
    """Inside ``watch_prefix``, count an attention call over whole sequences and compare its outputs with
    ``attend`` on the sequences one column shorter (the kernel calls it after each attention)."""
    watch = _WATCH.get()
    if watch is None or not query.shape[-2] == key.shape[-2] > 1:
        return
    watch.calls += 1
    if attention_mask is None or attention_mask.ndim != 4:  # the shorter pass's mask is not a slice of this one
        watch.equal = False
    elif watch.equal:
        mask = attention_mask[:, :, :-1, : key.shape[-2] - 1]
        shorter = attend(query[..., :-1, :], key[..., :-1, :], value[..., :-1, :], mask)
        watch.equal = torch.equal(out[:, :-1], shorter)


_INDEPENDENT: dict[tuple, bool] = {}


def rows_independent(model: torch.nn.Module, rows: int, fewer: int) -> bool:
    """Whether every linear layer of ``model`` but its output head, under the autocast in force, gives the
    first ``fewer`` rows of a ``rows``-row product exactly as a product of those rows alone. A matmul kernel
    picks its blocking by shape: CPU bf16 products and fp32 ones of a dozen rows or more compute each row
    alone, while fp32 products of a few rows take other kernels. Tried once per layer class, weight shape
    and row counts, on random rows (the kernel's choice depends on the shapes, not the values)."""
    head = model.get_output_embeddings()
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


class PromptPass:
    """The keys and values of a decode's pass over whole prompts, for a second decode of the same prompts
    whose cache holds every prompt column but the last (``prefix.prefilled_cache``). Handed to the decode
    loop as ``prompt_pass``, it keeps the first pass's cache and watches its attention (``PrefixWatch``);
    ``prefilled`` gives the second decode's cache where it is bit for bit the one ``prefilled_cache``
    computes, and ``None`` otherwise."""

    def __init__(self) -> None:
        self.watch = PrefixWatch()
        self.prompt_ids: torch.Tensor | None = None  # [n, P] the prompts of the pass
        self.prompt_mask: torch.Tensor | None = None
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (keys, values) [n, heads, P, d]
        self.cache_class: type | None = None

    def keep(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache) -> None:
        """Keep the cache of the pass over ``prompt_ids`` [n, P] (a ``DynamicCache``'s layers)."""
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.layers = [(layer.keys, layer.values) for layer in getattr(cache, "layers", ())]
        self.cache_class = type(cache)

    def prefilled(
        self, model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, repeats: int
    ):
        """``prefix.prefilled_cache(model, prompt_ids, prompt_mask, repeats)`` from the kept pass, or ``None``
        where that would not be its very numbers: other prompts, an attention the watch did not see at every
        layer or saw move, or linear layers whose rows depend on the row count (``rows_independent``)."""
        n, width = prompt_ids.shape
        same = (
            self.prompt_ids is not None
            and torch.equal(self.prompt_ids, prompt_ids)
            and torch.equal(self.prompt_mask, prompt_mask)
        )
        if not (same and width > 1 and self.watch.equal and self.watch.calls == len(self.layers) > 0):
            return None
        if not rows_independent(model, n * width, n * (width - 1)):
            return None
        cache = self.cache_class(
            [(k[..., :-1, :], v[..., :-1, :]) for k, v in self.layers], config=model.config
        )
        cache.batch_repeat_interleave(repeats)
        return cache
