"""What the pre-flight gate and the diagnosis share: the ``Check`` they report, and their probes.

A check says ``pass``, ``warn``, ``fail`` or ``skip``, the number it decided on (``value``) and the
bound it compared that number with, so a report can be read without the code. The probes run the
stage code itself: ``reference_kl`` scores the policy and, through ``grpo.model.scoring.score_reference``,
its reference as the step does (I9); ``entropy_step`` takes one step on the entropy bonus alone through
``core.multitask`` in the configured mode, as the step combines it (I7).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from grpo.config import MultitaskConfig
from grpo.core.losses import k3_kl, masked_mean, policy_loss_terms
from grpo.core.multitask import batch_gradients, combine_task_gradients, task_gradient
from grpo.model.scoring import RolloutInputs, score_inputs, score_reference

Status = Literal["pass", "warn", "fail", "skip"]
ENTROPY_TOL = 1e-6
"""Entropy changes within this many nats are fp32 noise, not a direction."""


@dataclass(frozen=True)
class Check:
    """One line of the pre-flight report or of the diagnosis."""

    name: str
    """Short name of the check."""
    status: Status
    """pass | warn | fail | skip; only ``fail`` stops the gate."""
    value: Any
    """The number (or numbers) the status is decided on."""
    detail: str
    """What was measured, in words."""
    hint: str = ""
    """What to try when the check does not pass."""
    invariant: str = ""
    """The DESIGN.md invariants the check guards (I1-I12)."""
    bound: Any = None
    """What ``value`` was compared with (a tolerance, a threshold, an expected value)."""
    unit: str = ""
    """What ``value`` and ``bound`` count or measure (``nats``, ``problems``, ...); empty for a plain number."""

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}


def bounded(
    name: str, invariant: str, value: float, bound: float, detail: str, hint: str, unit: str = ""
) -> Check:
    """``pass`` when ``value <= bound`` (a NaN fails), else ``fail`` with ``hint``."""
    ok = value <= bound  # False for NaN
    return Check(name, "pass" if ok else "fail", value, detail, "" if ok else hint, invariant, bound, unit)


@torch.no_grad()
def reference_kl(
    model: torch.nn.Module, inputs: RolloutInputs, reference: torch.nn.Module | None = None
) -> float:
    """Token-mean k3 KL between the policy and its reference (``score_reference``: the frozen SFT copy
    when given, else the adapter disabled, I9)."""
    policy = score_inputs(model, inputs).logprobs
    ref = score_reference(model, inputs, reference).logprobs
    mask = inputs.completion_mask
    return float(masked_mean(k3_kl(policy, ref, mask), mask))


@torch.no_grad()
def mean_entropy(model: torch.nn.Module, inputs: RolloutInputs) -> float:
    """Token-mean entropy (nats) of the policy's scored distribution over the completion tokens."""
    return float(masked_mean(score_inputs(model, inputs).entropy, inputs.completion_mask))


@torch.no_grad()
def reference_entropy(
    model: torch.nn.Module, inputs: RolloutInputs, reference: torch.nn.Module | None = None
) -> float:
    """Token-mean entropy (nats) of the reference's distribution (``score_reference``, I9)."""
    return float(masked_mean(score_reference(model, inputs, reference).entropy, inputs.completion_mask))


def entropy_step(
    model: torch.nn.Module,
    inputs: RolloutInputs,
    rows: dict[str, torch.Tensor],
    multitask: MultitaskConfig,
    entropy_coef: float,
    step_size: float,
) -> tuple[float, float, float]:
    """One gradient step of norm ``step_size`` on ``-entropy_coef * entropy`` alone, each task's gradient
    from its rows combined in the configured mode (``core.multitask``, as the step combines them) ->
    ``(before, after, gradient norm)``.

    ``rows``: task -> row indices of ``inputs``. The trainable weights are restored afterwards. With a
    positive coefficient the entropy must rise (I7); a zero gradient returns ``after == before``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    before = mean_entropy(model, inputs)
    try:
        direction = _entropy_direction(model, params, inputs, rows, multitask, entropy_coef)
        norm = float(direction.norm())
        if not math.isfinite(norm) or norm == 0.0:
            return before, before, norm
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= step_size / norm * direction[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
        after = mean_entropy(model, inputs)
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                param.copy_(value)
        model.zero_grad(set_to_none=True)
    return before, after, norm


def _entropy_direction(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    inputs: RolloutInputs,
    rows: dict[str, torch.Tensor],
    multitask: MultitaskConfig,
    entropy_coef: float,
) -> torch.Tensor:
    """The combined gradient ``[P]`` of ``-entropy_coef * entropy`` alone: each task's from its rows (zero
    advantages, no KL: only the entropy term has a gradient), combined in ``multitask``'s mode."""
    grads = {}
    for task, index in rows.items():
        part = inputs.rows(index)
        scored = score_inputs(model, part)
        terms, _ = policy_loss_terms(
            scored.logprobs,
            scored.logprobs.detach(),
            None,
            torch.zeros(len(index), device=scored.logprobs.device),
            part.completion_mask,
            scored.entropy,
            epsilon_low=0.2,
            epsilon_high=0.2,
            loss_type="grpo",
            max_completion_length=part.completion_mask.shape[1],
        )
        grads[task] = task_gradient(params, terms, 0.0, entropy_coef, multitask.reward_only, retain=False)
    zero = torch.cat([torch.zeros(p.numel(), device=p.device) for p in params])
    direction, _ = combine_task_gradients(
        batch_gradients(grads, zero, multitask.reward_only),
        tuple(rows),
        zero,
        mode=multitask.mode,
        c=multitask.cagrad_c,
        rescale=multitask.cagrad_rescale,
    )
    return direction
