"""Shared-prefix forward: each distinct prompt runs through the model once, its completions against
its key/value cache.

The G completions of a GRPO group share their prompt, and the prompts (80-130 tokens) are much
longer than the completions (a few tokens), so a plain forward over ``[prompt | completion]`` rows
recomputes every prompt G times. Causal attention makes the prompt's keys and values independent
of what follows, so running the prompt once and attending the completion tokens to its cache gives
the same logits, and, since the cache is an ordinary tensor of the graph, the same gradients: the
prompt's share of every row's gradient flows back through the cache expansion and is summed (Prefix
Grouper, arXiv 2506.05433). Prompts are found by content (ids and mask), so any selection of rows,
a micro-batch that splits a group included, is handled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo.core.attention import model_attention_mask
from grpo.core.batching import position_ids_from_mask


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


def shared_prefix_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + C]: left-padded prompts, then completions
    attention_mask: torch.Tensor,  # [B, P + C]: 1 = real token
    completion_width: int,  # C
) -> torch.Tensor:
    """Logits that score the last ``C`` tokens -> [B, C, V], equal to the last ``C + 1`` positions of a
    plain forward (without the final one) up to floating-point reassociation.

    The prompt's last position predicts completion token 0; completion tokens ``0 .. C - 2`` predict
    tokens ``1 .. C - 1``, so the completion pass runs ``C - 1`` tokens against the expanded cache.
    """
    prompt_width = input_ids.shape[1] - completion_width
    groups = prefix_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    ids, mask = input_ids[:, groups.start :], attention_mask[:, groups.start :]
    positions = position_ids_from_mask(mask)
    width = prompt_width - groups.start
    prefix = model(
        input_ids=ids[groups.first, :width],
        attention_mask=model_attention_mask(model, mask[groups.first, :width], width),
        position_ids=positions[groups.first, :width],
        logits_to_keep=1,
        use_cache=True,
    )
    first_logits = prefix.logits[groups.inverse]  # [B, 1, V]
    if completion_width == 1:
        return first_logits
    cache = prefix.past_key_values
    cache.reorder_cache(groups.inverse)  # index_select: every row gets its prompt's keys and values
    rest = model(
        input_ids=ids[:, width:-1],
        attention_mask=model_attention_mask(model, mask[:, :-1], completion_width - 1),
        position_ids=positions[:, width:-1],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first_logits, rest.logits], dim=1)


@torch.no_grad()
def prefilled_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, repeats: int):
    """The key/value cache of every prompt but its last column, computed once per prompt and repeated
    ``repeats`` times (row ``i`` of the result is prompt ``i // repeats``), for ``generate``: given
    it, ``generate`` runs only the last prompt column and the new tokens. prompt_ids, prompt_mask: [n, P]
    left-padded, P >= 2. Positions as ``generate`` counts them (real tokens only)."""
    out = model(
        input_ids=prompt_ids[:, :-1],
        attention_mask=model_attention_mask(model, prompt_mask[:, :-1], prompt_ids.shape[1] - 1),
        position_ids=position_ids_from_mask(prompt_mask)[:, :-1],
        logits_to_keep=1,
        use_cache=True,
    )
    cache = out.past_key_values
    cache.batch_repeat_interleave(repeats)
    return cache
