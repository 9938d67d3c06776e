"""Scoring inside the LM head: log-probs, entropy and logit statistics chunk by chunk of positions, from the
hidden states and the head's weight, never the ``[rows x tokens x vocabulary]`` logits.

Every number the loss reads is one per position (the log-prob of the sampled id, the entropy), yet on a
128k vocabulary the logits behind them, with their fp32 copies and gradients, are the largest tensors of a
GRPO step by far. ``score_completions`` therefore asks the model's output head for those numbers instead of
logits: a ``HeadRequest`` handed to the head for the span of one forward (``head_request``) says which ids to
score at which temperature, and a head that serves requests (``grpo.model.precision.Fp32Head``) returns
``score_in_head``'s packed ``[B, C, 2]`` (log-prob, entropy) in place of the logits, computed ``chunk_positions``
positions at a time: one chunk's logits exist at once, in the forward and in the backward. Done inside the
head's own forward, it keeps everything the model's forward does around the head: ``logits_to_keep``, peft's
wrapping, and FSDP's gathering of the head's weight during its module's forward and, through the hooks on
the module's output, during its backward.

The backward of a frozen head (LoRA, the reference and old passes) never recomputes the logits: the
log-prob and the entropy are scalars per position, so their gradients with respect to the hidden state are
the upstream scalar times a fixed vector. With ``z = logits / T``, ``d log p(id) / dz = onehot(id) - p`` and
``dH / dz = -p * (log p + H)``; carried through ``1 / T`` and the weight they give ``c = ((onehot - p) / T) @ W``
and ``e = (-p * (log p + H) / T) @ W`` ([N, H] each), which the forward computes chunk by chunk, and the
backward is ``g_logp * c + g_H * e``. (Not ``W[id] - p @ W``: for a confident token the two terms nearly
cancel.) ``e`` costs one more product per chunk and is kept only where the entropy's gradient is asked for
(``entropy_grad``); a gradient that reaches the entropy without it is an error, never a silent zero. A
trainable head (full fine-tuning, tied embeddings included) needs each position's ``[V]`` vector for its
weight's gradient, so there the backward recomputes each chunk's logits with the forward's own product.
The products of the backward run in ``HeadProduct.low_weight``'s dtype (autocast's under autocast, as every
other layer's backward; fp32 without), from the fp32 vectors rounded to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from grpo.errors import GrpoError

LOGITS_CHUNK_BYTES = 256 * 2**20
"""fp32 logits one chunk of positions holds (``chunk_positions``): 512 positions of a 128k vocabulary."""

STATISTICS = ("logits/max", "logits/top1_gap", "logits/top5_mass", "logits/max_prob")


class HeadScoringError(GrpoError, ValueError):
    """A head request that does not fit the head's input, or a gradient the pass was told not to carry."""


class HeadProduct(Protocol):
    """The head's product, prepared once per pass: what ``logits`` multiplies and how the backward multiplies."""

    low_weight: torch.Tensor  # [V, H] the weight in the backward's dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] fp32 -> [n, V] fp32 raw logits (bias included)."""
        ...


@dataclass
class HeadRequest:
    """What ``score_completions`` asks the output head for during one forward: the scores of the first
    ``C`` positions of ``[first | the head's input]`` (its input has ``C + 1``: the last position predicts
    nothing). The head answers with ``score`` and the caller finds in ``output`` what it returned (to
    check the model passed it on unchanged), in ``stats`` the logit statistics."""

    ids: torch.Tensor  # [B, C] long: the id each position scores (the completion tokens)
    temperature: float  # the sampling temperature: scores of softmax(logits / T) (I10)
    entropy: bool  # compute the entropy (else the log-probs alone: output [B, C, 1])
    entropy_grad: bool  # keep what the entropy's gradient needs on a frozen head (``e``)
    mask: torch.Tensor | None  # [B, C] positions the logit statistics average over; None: no statistics
    chunk_bytes: int = LOGITS_CHUNK_BYTES  # fp32 logits per chunk
    first: torch.Tensor | None = None  # [B, 1, H] hidden state put before the head's input (shared prefix)
    output: torch.Tensor | None = None  # [B, C, 2 or 1] what the head returned
    stats: dict[str, float] = field(default_factory=dict)  # filled by the head (with ``mask``)

    def score(
        self,
        hidden: torch.Tensor,  # [B, C + 1, H] the head's input ([B, C, H] after ``first``)
        weight: torch.Tensor,  # [V, H] fp32
        bias: torch.Tensor | None,  # [V] fp32
        prepare: Callable[[torch.Tensor, torch.Tensor | None], HeadProduct],
    ) -> torch.Tensor:
        """The head's answer, ``score_in_head``: [B, C, 2 or 1]. The head calls it and imports nothing from
        here, so the stages that never score (pretraining, SFT) do not depend on this module."""
        return score_in_head(hidden, weight, bias, self, prepare)


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if get_head is not None else None


def scores_in_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s output head serves ``HeadRequest``s (its class says ``scores_requests``). A head
    wrapped by something else (peft's LoRA on the head) does not: its wrapper would add to the scores."""
    return bool(getattr(type(_output_head(model)), "scores_requests", False))


@contextmanager
def head_request(model: torch.nn.Module, request: HeadRequest) -> Iterator[HeadRequest]:
    """Hand ``request`` to ``model``'s output head for the span of the block (one forward): the head finds
    it as its ``head_request`` and answers with ``request.score`` instead of logits."""
    if not scores_in_head(model):
        raise HeadScoringError(
            f"head request: {type(model).__name__}'s output head {type(_output_head(model)).__name__} does "
            "not score in place; score it from its logits (score_completions(..., full_logits=True))"
        )
    head = _output_head(model)
    head.head_request = request
    try:
        yield request
    finally:
        head.head_request = None


def chunk_positions(vocab: int, chunk_bytes: int) -> int:
    """Positions whose fp32 logits fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def score_in_head(
    hidden: torch.Tensor,  # [B, C + 1 - (first given), H] the head's input
    weight: torch.Tensor,  # [V, H] fp32
    bias: torch.Tensor | None,  # [V] fp32
    request: HeadRequest,
    prepare: Callable[[torch.Tensor, torch.Tensor | None], HeadProduct],
) -> torch.Tensor:
    """The head's answer to ``request``: [B, C, 2] (log-prob of each id, entropy) of ``softmax(z / T)``, or
    [B, C, 1] without the entropy, fp32, differentiable; ``request.stats`` filled where it has a mask.
    ``prepare(weight, bias)`` gives the product (``grpo.model.precision.head_product``)."""
    joined = hidden.float()
    if request.first is not None:
        joined = torch.cat([request.first.float(), joined], dim=1)
    rows, width = request.ids.shape
    if joined.shape[:2] != (rows, width + 1):
        raise HeadScoringError(
            f"head request: the head got {tuple(joined.shape[:2])} positions (the kept first column "
            f"included) to score ids of shape {(rows, width)}; it must get [B, C + 1]: pass the forward "
            "logits_to_keep=C + 1, or the completion columns after a kept prefill"
        )
    flat = joined[:, :width].reshape(rows * width, -1)  # [N, H]
    trainable = any(t is not None and t.requires_grad for t in (weight, bias))
    tracked = torch.is_grad_enabled() and (trainable or flat.requires_grad)
    spec = _Spec(
        ids=request.ids.reshape(-1),
        mask=None if request.mask is None else request.mask.reshape(-1).bool(),
        temperature=request.temperature,
        entropy=request.entropy,
        carry=tracked and not trainable,
        carry_entropy=tracked and not trainable and request.entropy and request.entropy_grad,
        chunk=chunk_positions(weight.shape[0], request.chunk_bytes),
        prepare=prepare,
        stats=request.stats,
    )
    request.output = HeadScores.apply(flat, weight, bias, spec).view(rows, width, -1)
    return request.output


@dataclass(frozen=True)
class _Spec:
    ids: torch.Tensor  # [N] long
    mask: torch.Tensor | None  # [N] bool: positions the statistics average over
    temperature: float
    entropy: bool
    carry: bool  # frozen head with gradients: keep c (and e) for a backward without logits
    carry_entropy: bool
    chunk: int  # positions per chunk
    prepare: Callable[[torch.Tensor, torch.Tensor | None], HeadProduct]
    stats: dict[str, float]  # filled by the forward


class _Chunk(NamedTuple):
    log_probs: torch.Tensor  # [n, V] log softmax(z / T)
    probs: torch.Tensor | None  # [n, V] softmax(z / T), where asked for
    logp: torch.Tensor  # [n] log p(id)
    entropy: torch.Tensor | None  # [n]


def _distribution(
    product: HeadProduct,
    hidden: torch.Tensor,  # [n, H] fp32
    ids: torch.Tensor,  # [n]
    temperature: float,
    with_entropy: bool,
    with_probs: bool,
    statistics: _Statistics | None = None,
    keep: torch.Tensor | None = None,  # [n] bool, with ``statistics``
) -> _Chunk:
    """One chunk's distribution; its logits exist only here."""
    raw = product.logits(hidden)  # [n, V] fp32
    log_probs = (raw / temperature).log_softmax(-1)  # [n, V] softmax(z / T), the sampling distribution (I10)
    if statistics is not None:
        statistics.add(raw, log_probs, keep, temperature)
    probs = log_probs.exp() if with_probs or with_entropy else None
    logp = log_probs.gather(-1, ids[:, None]).squeeze(-1)
    entropy = -(probs * log_probs).sum(-1) if with_entropy else None  # [n]
    return _Chunk(log_probs, probs, logp, entropy)


def _logp_direction(chunk: _Chunk, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``d log p(id) / d logits = (onehot(id) - p) / T`` -> [n, V] fp32."""
    direction = chunk.probs.neg()
    direction.scatter_add_(-1, ids[:, None], torch.ones_like(ids[:, None], dtype=direction.dtype))
    return direction.div_(temperature)


def _entropy_direction(chunk: _Chunk, entropy: torch.Tensor, temperature: float) -> torch.Tensor:
    """``dH / d logits = -p * (log p + H) / T`` -> [n, V] fp32."""
    return (chunk.log_probs + entropy[:, None]).mul_(chunk.probs).div_(-temperature)


def _through_weight(direction: torch.Tensor, product: HeadProduct) -> torch.Tensor:
    """``direction @ W`` in the backward's dtype (the fp32 vector rounded to it) -> [n, H]."""
    return direction.to(product.low_weight.dtype) @ product.low_weight


class _Statistics:
    """``logits_stats``' collapse signals summed over the masked positions, chunk by chunk."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(STATISTICS), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, raw: torch.Tensor, log_probs: torch.Tensor, keep: torch.Tensor, temperature: float) -> None:
        """raw, log_probs: [n, V]; keep: [n] bool."""
        top, top_ids = raw.topk(min(5, raw.shape[-1]), dim=-1)
        top = top / temperature  # [n, k] the largest z / T (division keeps the order and the values)
        gap = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else torch.zeros_like(top[:, 0])
        top_probs = log_probs.gather(-1, top_ids).exp()  # [n, k]
        values = torch.stack([top[:, 0], gap, top_probs.sum(-1), top_probs[:, 0]], dim=-1)  # [n, 4]
        self.sums += torch.where(keep[:, None], values, 0.0).double().sum(0)
        self.count += keep.sum()

    def means(self) -> dict[str, float]:
        if float(self.count) == 0:
            return dict.fromkeys(STATISTICS, 0.0)
        return {name: float(value) for name, value in zip(STATISTICS, self.sums / self.count, strict=True)}


class HeadScores(torch.autograd.Function):
    """``hidden [N, H]`` -> ``[N, 2]`` (log p(id), entropy) or ``[N, 1]``, chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, spec: _Spec):
        product = spec.prepare(weight, bias)
        scores = hidden.new_empty(hidden.shape[0], 2 if spec.entropy else 1)
        carried: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        statistics = _Statistics(hidden.device) if spec.mask is not None else None
        for start in range(0, hidden.shape[0], spec.chunk):
            part = slice(start, start + spec.chunk)
            ids = spec.ids[part]
            keep = None if statistics is None else spec.mask[part]
            chunk = _distribution(product, hidden[part], ids, spec.temperature, spec.entropy, spec.carry,
                                  statistics, keep)
            scores[part, 0] = chunk.logp
            if spec.entropy:
                scores[part, 1] = chunk.entropy
            if spec.carry:
                carried[0].append(_through_weight(_logp_direction(chunk, ids, spec.temperature), product))
            if spec.carry_entropy:
                direction = _entropy_direction(chunk, chunk.entropy, spec.temperature)
                carried[1].append(_through_weight(direction, product))
            del chunk
        if statistics is not None:
            spec.stats.update(statistics.means())
        ctx.spec = spec
        ctx.kind = hidden.device.type
        if spec.carry:
            c = torch.cat(carried[0]) if carried[0] else hidden.new_zeros(0, hidden.shape[1])
            e = torch.cat(carried[1]) if spec.carry_entropy and carried[1] else None
            ctx.save_for_backward(c, e)
        else:
            ctx.save_for_backward(hidden, weight, bias, scores)
        return scores

    @staticmethod
    def backward(ctx, grad):  # grad [N, 2 or 1]
        spec: _Spec = ctx.spec
        grad_logp = grad[:, 0]
        grad_entropy = grad[:, 1] if spec.entropy else None
        if spec.carry:
            return _carried_backward(ctx, grad_logp, grad_entropy), None, None, None
        with torch.autocast(device_type=ctx.kind, enabled=False):
            return (*_recomputed_backward(ctx, grad_logp, grad_entropy), None)


def _carried_backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """A frozen head's ``d hidden = g_logp * c + g_H * e`` [N, H] fp32, without the logits."""
    c, e = ctx.saved_tensors
    grad_hidden = grad_logp[:, None] * c.float()
    if grad_entropy is not None:
        if e is not None:
            grad_hidden += grad_entropy[:, None] * e.float()
        elif bool(grad_entropy.any()):
            raise HeadScoringError(
                "head scores: a gradient reached the entropy of a pass scored with entropy_grad=False, "
                "which keeps no entropy direction; score with entropy_grad=True where the loss steps on the "
                "entropy (the update does where grpo.loss.entropy_coef != 0)"
            )
    return grad_hidden


def _recomputed_backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
    """A trainable head's gradients of hidden [N, H], weight [V, H] and bias [V], each chunk's logits
    recomputed with the forward's product; ``dW = dz^T h`` and ``dh = dz W`` in the backward's dtype."""
    spec: _Spec = ctx.spec
    hidden, weight, bias, scores = ctx.saved_tensors
    product = spec.prepare(weight, bias)
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias) if need_bias else None
    for start in range(0, hidden.shape[0], spec.chunk):
        part = slice(start, start + spec.chunk)
        ids = spec.ids[part]
        chunk = _distribution(product, hidden[part], ids, spec.temperature, with_entropy=False, with_probs=True)
        dz = _logp_direction(chunk, ids, spec.temperature).mul_(grad_logp[part, None])  # [n, V]
        if grad_entropy is not None:
            dz += _entropy_direction(chunk, scores[part, 1], spec.temperature).mul_(grad_entropy[part, None])
        del chunk
        low = dz.to(product.low_weight.dtype)
        if need_hidden:
            grad_hidden[part] = low @ product.low_weight
        if need_weight:
            grad_weight += low.T @ hidden[part].to(low.dtype)
        if need_bias:
            grad_bias += dz.sum(0)
    return grad_hidden, grad_weight, grad_bias
