"""Padding and masks over token ids (I3, I4, I5, I11).

Everything here works on token ids only: prompts and completions are joined as ids, never decoded
and re-tokenized. Masks have one polarity: True/1 = the token takes part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from grpo.errors import GrpoError


class BatchingError(GrpoError, ValueError):
    """Tensors handed to a batching function do not have the shapes it needs."""


class PaddedBatch(NamedTuple):
    input_ids: torch.Tensor  # [B, P] long, left-padded
    attention_mask: torch.Tensor  # [B, P] long, 1 = real token


class CompletionMask(NamedTuple):
    mask: torch.Tensor  # [B, C] bool, True up to and including the first eos
    lengths: torch.Tensor  # [B] long, number of True per row
    truncated: torch.Tensor  # [B] bool, True where the row has no eos (hit max_new_tokens)


class SftBatch(NamedTuple):
    input_ids: torch.Tensor  # [B, T] long, left-padded
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    loss_mask: torch.Tensor  # [B, T] bool, True on supervised tokens, aligned to input_ids (not shifted)


class _IdsWithLossMask(Protocol):
    ids: Sequence[int]
    loss_mask: Sequence[bool]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> PaddedBatch:
    """Left-pad id lists to the longest one; the batch's prompt width is ``input_ids.shape[1]``."""
    if not len(seqs):
        raise BatchingError("left_pad: the batch is empty; pass at least one id sequence")
    width = max(len(seq) for seq in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq):
            input_ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
    return PaddedBatch(input_ids, attention_mask)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so a left-padded row sees the same positions as alone.

    attention_mask: [B, T] -> position_ids: [B, T] long (0 on leading padding).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def completion_ids_from_generated(sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The generated part of ``model.generate`` output on a left-padded batch (I4).

    sequences: [B, P + C] -> completion_ids: [B, C]. Every row's prompt ends at column P (the
    padded width), so the cut is at P for all rows; a per-row count of real prompt tokens used as a
    position would start the short rows inside their own prompt or padding.
    """
    if sequences.dim() != 2 or sequences.shape[1] < prompt_width:
        raise BatchingError(
            f"generated sequences of shape {tuple(sequences.shape)} are narrower than the prompt width "
            f"{prompt_width}; pass the full [B, P + C] output of generate() and P = input_ids.shape[1]"
        )
    return sequences[:, prompt_width:]


def completion_mask(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> CompletionMask:
    """Mask of each completion up to and including its first eos, built from positions (I5).

    completion_ids: [B, C]. Never ``id != pad``: with pad == eos (Llama-3) that would drop the eos
    the model must learn to emit; with pad inside the text it would cut it. A row whose first token
    is eos has length 1; a row without eos is truncated and fully selected.
    """
    if not len(eos_ids):
        raise BatchingError("completion_mask: eos_ids is empty; pass chat.end_of_turn_ids(tokenizer)")
    width = completion_ids.shape[1]
    eos = torch.as_tensor(list(eos_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)  # [B, C]
    has_eos = is_eos.any(dim=1)  # [B]
    first_eos = is_eos.long().argmax(dim=1)  # [B] index of the first True (0 when none)
    lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, width))  # [B]
    positions = torch.arange(width, device=completion_ids.device)  # [C]
    mask = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, C]
    return CompletionMask(mask, lengths, ~has_eos)


def join_prompt_completion(
    prompt_ids: torch.Tensor,  # [B, P]
    prompt_mask: torch.Tensor,  # [B, P] 1 = real prompt token
    completion_ids: torch.Tensor,  # [B, C]
    completion_mask: torch.Tensor,  # [B, C] True up to and including the first eos
) -> PaddedBatch:
    """The very ids that were generated, after their prompt: [B, P + C] (I3: nothing re-tokenized)."""
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise BatchingError(
            f"join_prompt_completion: ids and masks differ in shape (prompt {tuple(prompt_ids.shape)} vs "
            f"{tuple(prompt_mask.shape)}, completion {tuple(completion_ids.shape)} vs "
            f"{tuple(completion_mask.shape)}); pass each mask with its own ids"
        )
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise BatchingError(
            f"join_prompt_completion: {prompt_ids.shape[0]} prompts but {completion_ids.shape[0]} "
            "completions; repeat each prompt once per completion of its group before joining"
        )
    input_ids = torch.cat([prompt_ids, completion_ids.to(prompt_ids.dtype)], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    return PaddedBatch(input_ids, attention_mask)


def sft_batch(examples: Sequence[_IdsWithLossMask], pad_id: int) -> SftBatch:
    """Left-pad SFT examples; the loss mask stays aligned to ``input_ids`` (the trainer shifts it)."""
    for index, example in enumerate(examples):
        if len(example.ids) != len(example.loss_mask):
            raise BatchingError(
                f"sft_batch: example {index} has {len(example.ids)} ids but {len(example.loss_mask)} "
                "loss-mask entries; build examples with chat.render_sft"
            )
    input_ids, attention_mask = left_pad([example.ids for example in examples], pad_id)
    loss_mask = left_pad([[int(x) for x in example.loss_mask] for example in examples], 0).input_ids.bool()
    return SftBatch(input_ids, attention_mask, loss_mask)
