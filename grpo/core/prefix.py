"""Shared-prefix forward: each distinct prompt runs through the model once, its completions against
its key/value cache.

The G completions of a GRPO group share their prompt, and a prompt is usually much longer than its
completions, so a plain forward over ``[prompt | completion]`` rows recomputes every prompt G times. Causal attention makes the prompt's keys and values independent
of what follows, so running the prompt once and attending the completion tokens to its cache gives
the same logits, and, since the cache is an ordinary tensor of the graph, the same gradients: the
prompt's share of every row's gradient flows back through the cache expansion and is summed (Prefix
Grouper, arXiv 2506.05433). Prompts are found by content (ids and mask), so any selection of rows,
a micro-batch that splits a group included, is handled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from grpo.core.attention import model_attention_mask
from grpo.core.batching import position_ids_from_mask
from grpo.core.head_scores import HeadRequest, head_request
from grpo.errors import GrpoError


class PrefillError(GrpoError, ValueError):
    """A kept prefill that does not belong to the rows or the weights it is used with."""


class PrefixGroups(NamedTuple):
    first: torch.Tensor  # [n] row index of each distinct prompt's first occurrence
    inverse: torch.Tensor  # [B] which distinct prompt each row has
    start: int  # first column any distinct prompt uses (leading columns of padding only are cut)


def prefix_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PrefixGroups:
    """The distinct prompts of a batch. prompt_ids, prompt_mask: [B, P] left-padded."""
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)  # padding ids never split a group
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B]
    n = int(inverse.max()) + 1
    rows = torch.arange(inverse.shape[0], device=inverse.device)
    first = torch.full((n,), inverse.shape[0], dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # [n]
    real = prompt_mask.bool().any(dim=0)  # [P]
    start = int(real.nonzero()[0]) if real.any() else prompt_mask.shape[1] - 1
    return PrefixGroups(first, inverse, start)


def shared_prefix_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + C]: left-padded prompts, then completions
    attention_mask: torch.Tensor,  # [B, P + C]: 1 = real token
    completion_width: int,  # C
    prefills: Sequence[PromptPrefill] = (),
    segments: Sequence[Hashable] | None = None,  # [B] a label per row (its task); None: one segment
    request: HeadRequest | None = None,
) -> torch.Tensor:
    """Logits that score the last ``C`` tokens -> [B, C, V], equal to the last ``C + 1`` positions of a
    plain forward (without the final one) up to floating-point reassociation; with ``request``, the head's
    scores of those positions instead (``core.head_scores``: [B, C, 2 or 1], no logits).

    The prompts are prefilled (every column; the last one's head input and logits kept: they score
    completion token 0) once per distinct prompt, one forward per segment over its distinct prompts in order
    of first appearance (``keep_prefills``, the very function the rollout keeps its prefill with), then the
    ``C`` completion tokens run against the expanded cache: tokens ``0 .. C - 2`` score tokens ``1 .. C - 1``
    (the last one's output scores nothing, as the plain forward's last position). ``prefills``: the rollout's
    kept prefills of these prompts stand in for that prefill.
    The same rows and segments thus always run the same computation, in any precision: the stored
    reference and old log-probs and the update's are bit for bit alike where the weights are.
    """
    if not prefills:
        prompt_width = input_ids.shape[1] - completion_width
        prompts, mask = input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        labels = list(segments) if segments is not None else [0] * input_ids.shape[0]
        first = sorted(
            prefix_groups(prompts, mask).first.tolist()
        )  # one row of each distinct prompt, in order
        prefills = keep_prefills(model, prompts[first], mask[first], [labels[row] for row in first])
    return _prefilled_forward(model, input_ids, attention_mask, completion_width, prefills, request)


@torch.no_grad()
def prefilled_cache(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    repeats: int,
    segments: Sequence[Hashable] | None = None,
):
    """The key/value cache of every prompt but its last column, computed once per prompt and repeated
    ``repeats`` times (row ``i`` of the result is prompt ``i // repeats``), for ``generate``: given
    it, ``generate`` runs only the last prompt column and the new tokens. prompt_ids, prompt_mask: [n, P]
    left-padded, P >= 2. Positions as ``generate`` counts them (real tokens only).

    ``segments`` (a label per prompt): the passes ``keep_prefills`` runs, one per segment over its whole
    prompts, each row's first ``P - 1`` columns put back at its own index; without, one pass over those
    columns. A bf16 product's rounding depends on its shape, so only the same passes give a kept prefill's
    numbers; this is the plain construction that ``decode_cache`` of kept prefills must equal."""
    if segments is None:
        cache = _prefill(model, prompt_ids[:, :-1], prompt_mask[:, :-1])[0].past_key_values
    else:
        cache = _segment_prefills(model, prompt_ids, prompt_mask, segments)
    cache.batch_repeat_interleave(repeats)
    return cache


def _segment_prefills(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, segments: Sequence[Hashable]
):
    """One pass per segment over its whole prompts [n_s, P]; the cache of every column but the last, row
    ``i`` prompt ``i``."""
    layers, cache_class = None, None
    for label in dict.fromkeys(segments):
        rows = [i for i, s in enumerate(segments) if s == label]
        cache = _prefill(model, prompt_ids[rows], prompt_mask[rows])[0].past_key_values
        if layers is None:
            cache_class = type(cache)
            layers = [
                tuple(kv.new_empty((len(segments), *kv.shape[1:-2], kv.shape[-2] - 1, kv.shape[-1]))
                      for kv in (layer.keys, layer.values))
                for layer in cache.layers
            ]
        for (keys, values), layer in zip(layers, cache.layers, strict=True):
            keys[rows], values[rows] = layer.keys[..., :-1, :], layer.values[..., :-1, :]
    return cache_class(layers, config=model.config)


def _prefill(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, keep_hidden: bool = False):
    """The model's pass over the prompts [n, P]: its key/value cache, the last column's logits [n, 1, V]
    and, with ``keep_hidden``, the output head's input there [n, 1, H] (``None`` without). (Positions of
    left-padded prompts do not depend on later columns, so a prefix of the columns is prefilled by passing
    only those.)"""
    heard: list[torch.Tensor] = []
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if keep_hidden and get_head is not None else None
    hook = None if head is None else head.register_forward_pre_hook(lambda _, args: heard.append(args[0]))
    try:
        out = model(
            input_ids=prompt_ids,
            attention_mask=model_attention_mask(model, prompt_mask, prompt_ids.shape[1]),
            position_ids=position_ids_from_mask(prompt_mask),
            logits_to_keep=1,
            use_cache=True,
        )
    finally:
        if hook is not None:
            hook.remove()
    return out, heard[0] if heard else None


@dataclass(frozen=True)
class PromptPrefill:
    """The policy's keys and values of some prompts and their last column's head input and logits, with the
    autograd graph that made them: the rollout's prefill, kept so that the policy pass of the update does
    not run the same prompts through the same weights again. Gradients of the update's loss flow through
    the kept hidden state (or logits), keys and values into that graph, so the update's gradients are those
    of a fresh pass. (The kept hidden state is also what makes a sharded model's backward reach the last
    layer: FSDP gathers a layer's weights again when the gradient reaches its output.) The scoring in the
    head (``core.head_scores``) reads ``first_hidden``; the full-logits path reads ``first_logits``, one
    column per distinct prompt."""

    prompt_ids: torch.Tensor  # [n, P] left-padded, as the rollout padded them
    prompt_mask: torch.Tensor  # [n, P]
    index: torch.Tensor  # [n] which of the rollout's distinct prompts each row is
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values) [n, heads, P, d]
    first_logits: torch.Tensor  # [n, 1, V] the last prompt column's: they score completion token 0
    first_hidden: torch.Tensor | None  # [n, 1, H] the output head's input there (None: a model without one)
    weights: tuple[tuple[int, int], ...]  # (identity, version) of each trainable parameter when computed
    cache_class: (
        type  # the model's cache (a transformers ``DynamicCache``): built from (keys, values) per layer
    )


def trainable_weights(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Which tensor each trainable parameter is, and its in-place version counter (an optimizer step
    moves it): a kept prefill is of these weights exactly, or stale."""
    return tuple((id(p), p._version) for p in model.parameters() if p.requires_grad)


def keep_prefills(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, segments: Sequence[Hashable]
) -> tuple[PromptPrefill, ...]:
    """The prefill of the prompts, one forward per segment over its prompts in order (the update runs
    one graph per task in ``low_memory`` mode, so each task's backward must reach only its own prompts'
    graph), with the graph where grad is enabled (the rollout keeps it so).
    prompt_ids, prompt_mask: [n, P] left-padded, P >= 2; segments: [n] labels."""
    out = []
    weights = trainable_weights(model)
    for label in dict.fromkeys(segments):
        index = torch.tensor([i for i, s in enumerate(segments) if s == label], device=prompt_ids.device)
        ids, mask = prompt_ids[index], prompt_mask[index]
        prefill, hidden = _prefill(model, ids, mask, keep_hidden=True)
        cache = prefill.past_key_values
        layers = tuple((layer.keys, layer.values) for layer in cache.layers)
        out.append(PromptPrefill(ids, mask, index, layers, prefill.logits, hidden, weights, type(cache)))
    return tuple(out)


def decode_cache(model: torch.nn.Module, prefills: Sequence[PromptPrefill], repeats: int):
    """The kept prefills as the decode loop's cache of every prompt column but the last (the decode
    loop runs that one itself), without their graph: row ``i`` is distinct prompt ``i // repeats`` (as
    ``prefilled_cache``)."""
    index = torch.cat([p.index for p in prefills])
    order = torch.argsort(index).repeat_interleave(repeats)
    layers = [
        tuple(torch.cat([p.layers[i][kv] for p in prefills]).detach()[order][..., :-1, :] for kv in (0, 1))
        for i in range(len(prefills[0].layers))
    ]
    return prefills[0].cache_class(layers, config=model.config)


def _prefilled_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    prefills: Sequence[PromptPrefill],
    request: HeadRequest | None,
) -> torch.Tensor:
    """``shared_prefix_forward`` on kept prefills: each row's prompt is found among them by content."""
    prompt_width = input_ids.shape[1] - completion_width
    found, used = _find_prompts(model, input_ids[:, :prompt_width], attention_mask[:, :prompt_width], prefills)
    layers = [
        tuple(_joined([p.layers[i][kv] for p in used]) for kv in (0, 1)) for i in range(len(used[0].layers))
    ]
    cache = used[0].cache_class(layers, config=model.config)
    cache.reorder_cache(found)  # index_select: every row gets its prompt's keys and values
    positions = position_ids_from_mask(attention_mask)
    if request is not None:  # the head scores [first column | completion columns]
        request.first = _joined([p.first_hidden for p in used])[found]  # [B, 1, H]
    with contextlib.nullcontext() if request is None else head_request(model, request):
        rest = model(
            input_ids=input_ids[:, prompt_width:],
            attention_mask=model_attention_mask(model, attention_mask, completion_width),
            position_ids=positions[:, prompt_width:],
            past_key_values=cache,
            use_cache=True,
        ).logits
    if request is not None:
        return rest
    first_logits = _joined([p.first_logits for p in used])[found]  # [B, 1, V]
    return torch.cat([first_logits, rest[:, :-1]], dim=1)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _find_prompts(
    model: torch.nn.Module,
    prompts: torch.Tensor,  # [B, P] the rows' left-padded prompt ids
    mask: torch.Tensor,  # [B, P]
    prefills: Sequence[PromptPrefill],
) -> tuple[torch.Tensor, list[PromptPrefill]]:
    """``(found [B], used)``: each row's prompt among the kept prefills by content (its index in the prompts
    of ``used`` joined), and the prefills that hold any. PrefillError where the prefills are of other
    weights or another prompt width, or a row's prompt is in none of them."""
    if trainable_weights(model) != prefills[0].weights:
        raise PrefillError(
            "shared_prefix_forward: the kept prefill is of other weights (another model, or these "
            "moved since the rollout); it serves only its own model's update of its own step"
        )
    if prefills[0].prompt_ids.shape[1] != prompts.shape[1]:
        raise PrefillError(
            f"shared_prefix_forward: kept prefills are of prompts {prefills[0].prompt_ids.shape[1]} "
            f"columns wide, these rows' prompts {prompts.shape[1]}: pass the rollout's own rows"
        )
    used, offset = [], 0
    found = torch.full((prompts.shape[0],), -1, dtype=torch.long, device=prompts.device)
    for prefill in prefills:
        match = (
            (prompts[:, None] == prefill.prompt_ids[None]) & (mask[:, None] == prefill.prompt_mask[None])
        ).all(-1)
        hit = match.any(dim=1) & (found < 0)  # [B]
        if hit.any():
            found[hit] = offset + match.int().argmax(dim=1)[hit]
            used.append(prefill)
            offset += prefill.prompt_ids.shape[0]
    if bool((found < 0).any()):
        raise PrefillError(
            f"shared_prefix_forward: rows {(found < 0).nonzero().flatten().tolist()} have a prompt "
            "that no kept prefill has; pass the rollout's own rows or no prefills"
        )
    return found, used
