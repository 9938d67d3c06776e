"""Scoring completions: per-token log-probs, entropy and logit statistics (I10, I11).

Everything is computed on the temperature-scaled distribution, the one that sampled the tokens
(I10): entropy or log-probs of another distribution would make the KL, the ratio and the entropy
bonus talk about a policy that never acted. Positions are counted over real tokens only
(``position_ids_from_mask``), so a left-padded row scores exactly as it does alone (I11).

Two paths give the same numbers (``score_completions``): the model's output head scores the ids chunk by
chunk of positions (``core.head_scores``), never holding the ``[B, C, V]`` logits, forward or backward;
``full_logits`` takes the logits and differentiates through ``selective_log_softmax``,
``entropy_from_logits`` and ``logits_stats``: the readable reference the tests and the gate hold the
chunked path to, and the path of a model whose head does not score in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo.core.attention import model_attention_mask
from grpo.core.batching import position_ids_from_mask
from grpo.core.head_scores import LOGITS_CHUNK_BYTES, HeadRequest, head_request, scores_in_head
from grpo.core.prefix import PromptPrefill, shared_prefix_forward
from grpo.errors import GrpoError

DEFAULT_CHUNK_SIZE = 128
"""Rows of logits turned into fp32 probabilities at once by ``entropy_from_logits``."""


class ScoringError(GrpoError, ValueError):
    """Inputs to scoring do not fit together; the message names the value and the fix."""


class Scored(NamedTuple):
    logprobs: torch.Tensor  # [B, C] fp32, log p_T(completion token), with grad
    entropy: torch.Tensor | None  # [B, C] fp32, entropy of p_T at each completion position, with grad
    logits_stats: dict[str, float]  # logits/max, logits/top1_gap, logits/top5_mass, logits/max_prob (no grad)
    # (``entropy`` None and no statistics when scored with ``logprobs_only``)


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits).gather(ids)`` without materialising the full log-softmax.

    logits: [B, T, V] (any float dtype), ids: [B, T] long -> [B, T] fp32.

    fp32/fp64: gather the selected logit and subtract a logsumexp computed one row at a time.
    bf16/fp16: logsumexp in low precision loses digits, so each row is upcast to fp32 on its own
    (peak memory one row of fp32 logits, as in TRL's ``selective_log_softmax``).
    """
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [B, T]
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # [B, T]
        return (selected - lse).float()
    rows = []
    for row_logits, row_ids in zip(logits, ids, strict=True):
        row_logps = F.log_softmax(row_logits.float(), dim=-1)  # [T, V] fp32
        rows.append(row_logps.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis, in fp32, ``chunk_size`` positions at a time.

    logits: [..., V] -> [...] fp32. ``H = -sum(softmax(z) * log_softmax(z))``: ``log_softmax``
    subtracts the max logit first, so the result keeps fp32 precision at any logit scale (the form
    ``logsumexp(z) - sum(p * z)`` cancels two large numbers and loses digits once logits are ~60).
    A zero probability contributes 0 (its log-probability is finite). Differentiable.
    """
    if chunk_size < 1:
        raise ScoringError(f"entropy_from_logits: chunk_size must be >= 1 (got {chunk_size}); use e.g. 128")
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    chunks = []
    # ``split``, not slicing: the backward of a slice is a zero tensor of the whole [N, V] per chunk,
    # split's is one concatenation of the chunks' gradients (the same numbers).
    for rows in torch.split(flat, chunk_size):
        z = rows.float()  # [n, V]
        log_probs = torch.log_softmax(z, dim=-1)
        chunks.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    return torch.cat(chunks).reshape(logits.shape[:-1])  # no rows: split gives one empty chunk


@torch.no_grad()
def logits_stats(logits: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Collapse signals, averaged over the positions where ``mask`` is True.

    logits: [N, V] or [B, T, V]; mask: [N] or [B, T] (True/1 = position takes part).
    ``logits/max``: largest logit; ``logits/top1_gap``: top-1 minus top-2 logit;
    ``logits/top5_mass``: probability mass of the five most likely tokens; ``logits/max_prob``:
    probability of the most likely token (near 1 everywhere = collapse). All 0.0 when the mask
    selects nothing.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    keep = mask.reshape(-1).bool()  # [N]
    if flat.shape[0] != keep.shape[0]:
        raise ScoringError(
            f"logits_stats: mask has {keep.shape[0]} positions but logits have {flat.shape[0]}"
        )
    names = ("logits/max", "logits/top1_gap", "logits/top5_mass", "logits/max_prob")
    if not keep.any():
        return dict.fromkeys(names, 0.0)
    z = flat[keep].float()  # [n, V]
    top = z.topk(min(5, z.shape[-1]), dim=-1).values  # [n, k]
    gap = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else torch.zeros_like(top[:, 0])
    top_probs = torch.exp(top - torch.logsumexp(z, dim=-1, keepdim=True))  # [n, k]
    values = (top[:, 0].mean(), gap.mean(), top_probs.sum(dim=-1).mean(), top_probs[:, 0].mean())
    return {name: float(value) for name, value in zip(names, values, strict=True)}


def completion_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + C] long: left-padded prompts, then completions
    attention_mask: torch.Tensor,  # [B, P + C]: 1 = real token
    completion_width: int,  # C
    shared_prefix: bool = False,
    prefills: Sequence[PromptPrefill] = (),
    segments: Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """The raw logits that score the last ``C`` tokens -> [B, C, V] (the full-logits path's forward)."""
    return _completion_forward(model, input_ids, attention_mask, completion_width, shared_prefix, prefills, segments)


def _completion_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    shared_prefix: bool,
    prefills: Sequence[PromptPrefill],
    segments: Sequence[Hashable] | None,
    request: HeadRequest | None = None,
) -> torch.Tensor:
    """The forward that scores the last ``C`` tokens: their logits [B, C, V], or with ``request`` the
    head's scores of them [B, C, 2 or 1]."""
    if shared_prefix:
        return shared_prefix_forward(
            model, input_ids, attention_mask, completion_width, prefills, segments, request
        )
    with contextlib.nullcontext() if request is None else head_request(model, request):
        out = model(
            input_ids=input_ids,
            attention_mask=model_attention_mask(model, attention_mask, input_ids.shape[1]),
            position_ids=position_ids_from_mask(attention_mask),
            logits_to_keep=completion_width + 1,
            use_cache=False,
        ).logits
    return out if request is not None else out[:, :-1, :]


def score_completions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + C] long: left-padded prompts, then completions
    attention_mask: torch.Tensor,  # [B, P + C]: 1 = real token
    completion_width: int,  # C
    temperature: float,
    shared_prefix: bool = False,
    prefills: Sequence[PromptPrefill] = (),
    segments: Sequence[Hashable] | None = None,
    logprobs_only: bool = False,
    entropy_grad: bool = True,
    full_logits: bool = False,
    chunk_bytes: int | None = None,
) -> Scored:
    """Log-probs and entropy of the last ``C`` tokens under ``softmax(z / T)``.

    Only the last ``C + 1`` positions reach the head (``logits_to_keep``): position t predicts token t + 1,
    so positions ``P - 1 .. P + C - 2`` score the completion. Gradients flow through ``logprobs`` and
    ``entropy``; the statistics are computed without them. Works with peft-wrapped models (the keyword
    arguments pass through to the base model).
    ``shared_prefix``: each distinct prompt runs once and its completions against its key/value
    cache (``grpo.core.prefix``): the same numbers, without recomputing a prompt G times; with
    ``prefills`` (the rollout's kept prefills of these prompts) without running the prompts at all;
    ``segments`` (a label per row, its task): the prompts are prefilled one forward per segment, as the
    rollout keeps them, so every pass over the same rows computes alike.
    ``logprobs_only``: the log-probs alone (entropy None, no statistics), the very numbers of a full
    scoring: the reference and old log-probs need nothing else.
    ``entropy_grad``: whether a gradient may reach the entropy (False saves one product per chunk of a
    frozen head; a gradient that reaches it then raises). ``chunk_bytes``: fp32 logits per chunk
    (``core.head_scores.LOGITS_CHUNK_BYTES`` when None).
    ``full_logits``: score from the ``[B, C, V]`` logits (the readable reference path; a model whose head
    does not serve ``core.head_scores`` requests always takes it).
    """
    _check_scoring(input_ids.shape[1], completion_width, temperature)
    forward = (model, input_ids, attention_mask, completion_width, shared_prefix, prefills, segments)
    if full_logits or not scores_in_head(model):
        return _score_logits(completion_logits(*forward), input_ids, attention_mask, temperature, logprobs_only)
    return _score_in_head(forward, temperature, logprobs_only, entropy_grad, chunk_bytes)


def _check_scoring(width: int, completion_width: int, temperature: float) -> None:
    """ScoringError unless ``1 <= completion_width < width`` and ``temperature > 0``."""
    if not 1 <= completion_width < width:
        raise ScoringError(
            f"score_completions: completion_width must be in [1, {width - 1}] for input width {width} "
            f"(got {completion_width}); pass the width of the completion block of input_ids"
        )
    if temperature <= 0:
        raise ScoringError(
            f"score_completions: temperature must be > 0 (got {temperature}); pass the sampling temperature"
        )


def _score_in_head(
    forward: tuple,  # ``_completion_forward``'s arguments: model, input_ids, attention_mask, completion_width, ...
    temperature: float,
    logprobs_only: bool,
    entropy_grad: bool,
    chunk_bytes: int | None,
) -> Scored:
    """``score_completions`` in the output head, chunk by chunk of positions (``core.head_scores``)."""
    model, input_ids, attention_mask, completion_width = forward[:4]
    request = HeadRequest(
        ids=input_ids[:, -completion_width:],
        temperature=temperature,
        entropy=not logprobs_only,
        entropy_grad=entropy_grad,
        mask=None if logprobs_only else attention_mask[:, -completion_width:],
        chunk_bytes=LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
    )
    scores = _completion_forward(*forward, request)  # [B, C, 2 or 1]
    if request.output is None or scores is not request.output:
        raise ScoringError(
            f"score_completions: {type(model).__name__}'s forward did not return its output head's scores "
            "unchanged (a logit scale or soft-capping after the head?): it cannot be scored in the head; "
            "score it with full_logits=True (params.yaml: grpo.full_logits: true)"
        )
    if logprobs_only:
        return Scored(scores[..., 0], None, {})
    return Scored(scores[..., 0], scores[..., 1], request.stats)


def _score_logits(
    raw: torch.Tensor,  # [B, C, V] the raw logits of the completion positions
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    logprobs_only: bool,
) -> Scored:
    """``score_completions`` from the full logits, with autograd through them."""
    completion_width = raw.shape[1]
    logits = raw / temperature  # [B, C, V], the sampling distribution (I10)
    completion_ids = input_ids[:, -completion_width:]  # [B, C]
    logprobs = selective_log_softmax(logits, completion_ids)  # [B, C]
    if logprobs_only:
        return Scored(logprobs, None, {})
    entropy = entropy_from_logits(logits)  # [B, C]
    stats = logits_stats(logits, attention_mask[:, -completion_width:])
    return Scored(logprobs, entropy, stats)
