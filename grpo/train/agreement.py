"""The step's run-time invariants, checked on tensors it already has, before any weight moves.

**Sampler and scorer agree** (every step). The decode records, for each token it drew, what it computed
(``Rollout.sampler``, ``generation.SamplerRecord``); the step holds the update's first policy pass (or the
stored old log-probs, ``grpo.num_iterations > 1``) to it:

- I3: the ids the step scores are the ids the decode drew, every column of every row (a stop token
  drawn but written as another id shows here);
- I5: the completion mask ends at the first stop token the decode drew;
- I10: each token's log-prob under ``softmax(z / T)`` is the sampler's within the precision's bound
  (``token_bounds``): a token decoded against another prompt's keys and values, or scored at another
  temperature, differs by far more; and the tokens were drawn from ``softmax(z / T)`` up to the masking
  of top-k, top-p and EOS suppression, which change no kept logit, unless a presence or frequency penalty
  is configured (``SamplerRecord.reshaped``: a temperature applied twice on the sampling side shows here).

It logs the gap as the rollout/train mismatch verl and TRL's vLLM path report, under TRL's names
(``sampling/sampling_logp_difference/mean|max``, as ``core.importance`` reports another engine's).

**The first step of a fresh run** (I8, I9): the policy is its reference, so every token's policy log-prob
equals the reference's (KL 0) and the stored old one (ratio 1) within the same bound.

A violation raises ``StepInvariantError`` on every process (one that raised alone would leave the others in
the next collective), naming the invariant, the rows and the gap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.core.batching import completion_mask
from grpo.errors import GrpoError
from grpo.model.generation import SamplerRecord
from grpo.model.precision import autocast_enabled
from grpo.train import collectives
from grpo.train.step_types import ScoredBatch, Step
from grpo.train.update import PolicyPass, score_parts

LOGPROB_BOUND = 1e-4
"""fp32: two scorings of the same token through different kernels and cache layouts, at T = 1; below T = 1
the logits' float noise is divided by T, so the bound is this / T."""
BF16_STEPS = 8 * 2**-8
"""bf16 autocast: the body's matmuls round to 8 mantissa bits, and two passes of different shapes (one token
at a time against the cache, the completions at once) round differently. The differences do not stay at
one rounding of the logits: they enter the residual stream at every layer and accumulate, so two correct
passes of a deep model differ by a few bf16 steps of a scaled logit (docs/invariants.md has the measured
spread; the libraries' own ``generate`` and forward differ as much as the fast paths do). The bound is
``8 * 2^-8 * max |z / T|`` at each position: a margin over that spread, and still a fraction of a nat where
tokens decoded against another prompt's cache, or at another temperature, are off by nats. The head is
fp32 (CUDA: a split-bf16 product, off by about 2^-15 of a term, far inside it)."""
BF16_FLOOR = 1e-3
"""The bf16 bound where every scaled logit is small (the noise of the fp32 parts is not scaled by them)."""


class StepInvariantError(GrpoError):
    """A run-time invariant failed: the step stopped before its optimizer moved any weight."""

    def __init__(self, message: str, invariant: str) -> None:
        super().__init__(message)
        self.invariant = invariant


def token_bounds(scale: torch.Tensor, temperature: float, bf16: bool) -> torch.Tensor:
    """The bound of each token's log-prob gap [N, C] from the largest scaled logit there ``scale`` [N, C]:
    ``LOGPROB_BOUND / min(1, T)`` in fp32, ``max(BF16_FLOOR, BF16_STEPS * scale)`` under bf16."""
    fp32 = torch.full_like(scale, LOGPROB_BOUND / min(1.0, temperature))
    return torch.maximum(fp32, (BF16_STEPS * scale).clamp(min=BF16_FLOOR)) if bf16 else fp32


def _rows(bad: torch.Tensor) -> list[int]:
    return bad.nonzero().flatten().tolist()


def _worst(gap: torch.Tensor, bound: torch.Tensor, inside: torch.Tensor) -> str:
    """Where the gap exceeds its bound the most: ``row r, column c: gap g > bound b``."""
    excess = torch.where(inside, gap - bound, -torch.inf)
    row, column = divmod(int(excess.argmax()), gap.shape[1])
    return f"row {row}, column {column}: {float(gap[row, column]):.3g} > {float(bound[row, column]):.3g}"


def sampler_problem(
    record: SamplerRecord,
    completion_ids: torch.Tensor,  # [N, C] what the step scores after the prompts
    mask: torch.Tensor,  # [N, C] bool, the step's completion mask
    scored: torch.Tensor,  # [N, C] the scorer's log-probs of those ids under softmax(z / T)
    eos_ids: list[int],
    penalised: bool,  # a presence or frequency penalty is configured
    bounds: torch.Tensor,  # [N, C] token_bounds
) -> tuple[str, str] | None:
    """``(invariant, what is wrong)`` of the first agreement that fails, or ``None``."""
    drawn = record.ids.to(completion_ids.device)
    if drawn.shape != completion_ids.shape or not torch.equal(drawn, completion_ids):
        if drawn.shape != completion_ids.shape:
            return "I3", f"the decode drew {tuple(drawn.shape)} ids, the step scores {tuple(completion_ids.shape)}"
        rows = _rows((drawn != completion_ids).any(1))
        row = rows[0]
        column = int((drawn[row] != completion_ids[row]).int().argmax())
        return "I3", (
            f"rows {rows} score other ids than the decode drew (row {row}, column {column}: drew "
            f"{int(drawn[row, column])}, scored {int(completion_ids[row, column])}): a drawn token, a stop token "
            "included, must be recorded as drawn"
        )
    expected = completion_mask(drawn, eos_ids).mask.to(mask.device)
    if not torch.equal(expected, mask.bool()):
        rows = _rows((expected != mask.bool()).any(1))
        return "I5", f"rows {rows}: the completion mask does not end at the first stop token the decode drew"
    reshaped = record.reshaped.to(mask.device) & mask.bool()
    if not penalised and bool(reshaped.any()):
        return "I10", (
            f"rows {_rows(reshaped.any(1))}: the tokens were drawn from a distribution other than softmax(z / T) "
            "(kept logits changed, and no presence or frequency penalty is configured): a temperature applied "
            "twice, or a processor that reshapes the logits"
        )
    gap = (record.scored.to(scored.device) - scored.float()).abs()
    inside = mask.bool()
    if bool((gap > bounds)[inside].any()) or not bool(torch.isfinite(gap[inside]).all()):
        rows = _rows(((gap > bounds) | ~torch.isfinite(gap)).logical_and(inside).any(1))
        return "I10", (
            f"rows {rows}: the scorer's log-prob of a token is not the sampler's ({_worst(gap, bounds, inside)}): "
            "the tokens were drawn from another distribution than the one scored (another prompt's keys and "
            "values, another temperature, another cache)"
        )
    return None


def agreement_stats(record: SamplerRecord, mask: torch.Tensor, scored: torch.Tensor, bounds: torch.Tensor) -> dict:
    """The rollout/train mismatch of the step under TRL's names, and its largest share of the bound."""
    inside = mask.bool()
    gap = (record.scored.to(scored.device) - scored.float()).abs()[inside]
    if gap.numel() == 0:
        return {}
    return {
        "sampling/sampling_logp_difference/mean": float(gap.mean()),
        "sampling/sampling_logp_difference/max": float(gap.max()),
        "sampling/sampling_logp_difference/max_over_bound": float((gap / bounds[inside]).max()),
        "sampling/reshaped_frac": float(record.reshaped.to(mask.device)[inside].float().mean()),
    }


def first_step_problem(
    policy: torch.Tensor,  # [N, C] the update's first policy pass
    reference: torch.Tensor | None,  # [N, C] the stored reference log-probs
    old: torch.Tensor | None,  # [N, C] the stored old log-probs (num_iterations > 1)
    mask: torch.Tensor,  # [N, C]
    bounds: torch.Tensor,  # [N, C]
) -> tuple[str, str] | None:
    """``(invariant, what is wrong)`` where the first step's policy is not its reference (I9: KL must be 0)
    or not the policy the old log-probs were stored with (I8: ratio 1), or ``None``."""
    inside = mask.bool()
    for stored, invariant, what in (
        (reference, "I9", "the reference's log-probs (KL must be 0 at the first step: is the reference the SFT policy?)"),
        (old, "I8", "the stored old log-probs (the ratio must be 1 at the first step)"),
    ):
        if stored is None:
            continue
        gap = (policy.float() - stored.float()).abs()
        bad = ((gap > bounds) | ~torch.isfinite(gap)) & inside
        if bool(bad.any()):
            delta = (stored.float() - policy.float())[inside]
            kl = float((delta.exp() - delta - 1).mean())
            return invariant, (
                f"rows {_rows(bad.any(1))}: the policy's log-probs differ from {what}; token-mean k3 KL {kl:.3g}, "
                f"{_worst(gap, bounds, inside)}"
            )
    return None


def runs_bf16(step: Step) -> bool:
    """Whether the step's passes round in bf16: under bf16 autocast, or with weights loaded in bf16."""
    weights = {p.dtype for p in step.model.parameters()}
    return autocast_enabled(step.accelerator.device, step.cfg.grpo.bf16) or torch.bfloat16 in weights


def _has_reference(step: Step) -> bool:
    return step.reference is not None or hasattr(step.model, "disable_adapter")


def step_checks(step: Step, batch: ScoredBatch, first: bool) -> Callable[[PolicyPass], dict[str, float]]:
    """What ``update.update`` runs on its first policy pass before the optimizer steps: the sampler/scorer
    agreement where the rollout carries a record (the trainer's own engine), and with ``first`` (the first
    step of a fresh run) the first step's invariants; it returns the agreement's statistics and raises
    ``StepInvariantError`` on every process where any one fails."""

    def check(policy: PolicyPass) -> dict[str, float]:
        mask, record = batch.completion_mask, batch.sampler
        scored = batch.old_logprobs if batch.old_logprobs is not None else policy.logprobs
        scale = torch.zeros(mask.shape, device=mask.device) if record is None else record.scale.to(mask.device)
        bounds = token_bounds(scale, batch.inputs.temperature, runs_bf16(step))
        problem, stats = None, {}
        if record is not None:
            sampling = step.cfg.grpo.sampling
            penalised = bool(sampling.presence_penalty or sampling.frequency_penalty)
            ids = batch.inputs.input_ids[:, -mask.shape[1] :]
            problem = sampler_problem(record, ids, mask, scored, step.eos_ids, penalised, bounds)
            stats = agreement_stats(record, mask, scored, bounds)
        if problem is None and first:
            reference = batch.ref_logprobs
            if reference is None and _has_reference(step):  # beta == 0: scored here, for this check only
                reference = score_parts(step, batch.inputs, batch.rows, adapter=False)
            problem = first_step_problem(policy.logprobs, reference, batch.old_logprobs, mask, bounds)
        if collectives.count_anywhere(step.accelerator, float(problem is not None)):
            invariant, what = problem or ("I3, I5, I8, I9, I10", "a run-time invariant failed on another process")
            raise StepInvariantError(f"{what} ({invariant})", invariant)
        return stats

    return check
