"""The update of a GRPO step: scoring -> loss -> gradient combination -> optimizer, over a scored batch.

For each of ``grpo.num_iterations`` passes: the policy scores the batch's rows, one part at a time
(``parts``: per task and micro-batch, or every task together), each task's loss terms are taken from
its own rows (``task_losses``), their gradients are summed over the micro-batches, combined once in the
configured mode (``core.multitask``), clipped, and the optimizer steps. ``sum`` mode without per-task
statistics differentiates the summed loss once instead (the sum is linear).

Each loss is scaled by its part's share of the task's rows (or tokens for ``token_mean``) over all
processes (``Totals``), so the gradients summed over micro-batches and processes are the one-process
gradient of the whole batch, however the rows are spread.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from grpo.core.losses import LossTerms, policy_loss_terms, total_loss
from grpo.core.multitask import TaskGradients, accumulate, check_finite, combine_task_gradients, task_gradient
from grpo.data.schema import TASKS
from grpo.errors import GrpoError
from grpo.model.scoring import RolloutInputs, Scored, score_inputs, score_reference
from grpo.train import collectives
from grpo.train.step_types import ScoredBatch, Step


class NonFiniteError(GrpoError):
    """A reward, loss or gradient is NaN/Inf; the step is abandoned before anything is updated."""


@dataclass(frozen=True)
class Totals:
    """Rows and completion tokens of each task over ALL processes: the denominators of each task's
    loss, so the processes' losses (and gradients) summed are the one-process ones of the global batch."""

    rows: dict[str, float]
    tokens: dict[str, float]


def global_totals(step: Step, batch: ScoredBatch) -> Totals:
    """Each task's rows and completion tokens, summed over the processes (one small all-reduce)."""
    local = torch.tensor(
        [
            [float(len(batch.rows[t])), float(batch.completion_mask[batch.rows[t]].sum())]
            if t in batch.rows
            else [0.0, 0.0]
            for t in TASKS
        ],
        dtype=torch.float64,
    )  # [K, 2]
    local = collectives.sum_tensor(step.accelerator, local).cpu()
    return Totals(
        {t: float(local[i, 0]) for i, t in enumerate(TASKS)},
        {t: float(local[i, 1]) for i, t in enumerate(TASKS)},
    )


def parts(step: Step) -> list[tuple[tuple[str, ...], int]]:
    """What each policy pass scores at once, in order: ``(tasks, micro-batch)``. One graph per task
    (``low_memory``), or one over every task (the shared graph, and ``sum``'s single backward). Every
    process passes every task: under FSDP each forward and backward is a collective."""
    together = step.summed or not step.cfg.grpo.multitask.low_memory
    subsets = [TASKS] if together else [(task,) for task in TASKS]
    return [(subset, micro) for micro in range(step.cfg.grpo.grad_accum) for subset in subsets]


def part_rows(
    step: Step, rows: dict[str, torch.Tensor], subset: tuple[str, ...], micro: int
) -> dict[str, tuple[torch.Tensor, bool]]:
    """The rows of each task of ``subset`` in micro-batch ``micro`` (``rows``: task -> its rows of the
    batch), each with whether they are real. Under FSDP a task without rows here gets one placeholder row
    (0, not real): every process must run the same forwards and backwards, each is a collective there."""
    found = {t: torch.tensor_split(rows[t], step.cfg.grpo.grad_accum)[micro] for t in subset if t in rows}
    found = {t: (idx, True) for t, idx in found.items() if len(idx)}
    if step.space.sharded:
        placeholder = torch.zeros(1, dtype=torch.long, device=next(iter(rows.values())).device)
        found = {t: found.get(t, (placeholder, False)) for t in subset}
    return found


def score_parts(
    step: Step,
    inputs: RolloutInputs,
    rows: dict[str, torch.Tensor],
    adapter: bool,
    model: torch.nn.Module | None = None,
) -> torch.Tensor:
    """The policy's (``adapter``) or the reference's log-probs of every row [N, C], scored part
    by part exactly as the update scores them (``parts``, ``part_rows``, one prefill forward per task):
    the stored old and reference log-probs are then the very numbers the update's pass gives where the
    weights are the same (ratio 1 and KL 0 at the start, bit for bit, in any precision). ``model``:
    another model scored the same way (the gate compares a fresh load of the SFT weights). Log-probs
    only: the entropy and logit statistics over the ``[N, C, V]`` logits are the update's to compute."""
    logprobs = torch.zeros(inputs.completion_mask.shape, device=inputs.completion_mask.device)
    for subset, micro in parts(step):
        found = part_rows(step, rows, subset, micro)
        if not found:
            continue
        idx = torch.cat([part for part, _ in found.values()])
        segments = [task for task, (part, _) in found.items() for _ in range(len(part))]
        with torch.no_grad(), step.autocast():
            if adapter or model is not None:
                scored = score_inputs(
                    model or step.model,
                    inputs.rows(idx),
                    shared_prefix=step.shares_prefix,
                    segments=segments,
                    logprobs_only=True,
                    full_logits=step.cfg.grpo.full_logits,
                )
            else:  # I9: the frozen SFT copy (full fine-tuning) or the adapter disabled (LoRA)
                scored = score_reference(
                    step.model,
                    inputs.rows(idx),
                    step.reference,
                    shared_prefix=step.shares_prefix,
                    segments=segments,
                    logprobs_only=True,
                    full_logits=step.cfg.grpo.full_logits,
                )
        logprobs[idx] = scored.logprobs.float()
    return logprobs


def _share(batch: ScoredBatch, totals: Totals, task: str, part: torch.Tensor, loss_type: str) -> float:
    """The part's share of the task's loss over the GLOBAL batch (rows, or tokens for token_mean)."""
    if loss_type == "token_mean":
        return float(batch.completion_mask[part].sum()) / max(totals.tokens[task], 1.0)
    return len(part) / totals.rows[task]


def _score_rows(step: Step, batch: ScoredBatch, rows: torch.Tensor, segments: list[str]) -> Scored:
    """The policy's log-probs and entropy of ``rows`` (with grad), as the reference and old log-probs
    were scored: the same temperature (I10), the same parts and prefill path, the rollout's kept prefill.
    The entropy carries a gradient only where the loss steps on it (``entropy_coef``)."""
    with step.autocast():
        return score_inputs(
            step.model,
            batch.inputs.rows(rows),
            shared_prefix=step.shares_prefix,
            prefills=batch.prefills,
            segments=segments,
            entropy_grad=step.cfg.grpo.loss.entropy_coef != 0,
            full_logits=step.cfg.grpo.full_logits,
        )


class PassPart(NamedTuple):
    """One part of a policy pass (the rows ``task_losses`` scored at once), detached: what their loss was
    computed from. ``policy_pass`` puts a pass's parts back in row order, a ``PolicyPass``."""

    rows: torch.Tensor  # [n] row indices
    logprobs: torch.Tensor  # [n, C]
    entropy: torch.Tensor  # [n, C]


def task_losses(
    step: Step, batch: ScoredBatch, totals: Totals, subset: tuple[str, ...], micro: int
) -> tuple[dict[str, LossTerms], dict[str, dict[str, float]], PassPart | None]:
    """One forward over micro-batch ``micro`` of the rows of ``subset``; each task's loss terms from its
    own rows, scaled by their share, its statistics weighted by its share of the task's tokens, and the
    pass itself (detached).
    A placeholder row under FSDP (``part_rows``) weighs 0."""
    loss_cfg = step.cfg.grpo.loss
    found = {
        t: (idx, _share(batch, totals, t, idx, loss_cfg.loss_type) if real else 0.0)
        for t, (idx, real) in part_rows(step, batch.rows, subset, micro).items()
    }
    if not found:
        return {}, {}, None
    rows = torch.cat([p[0] for p in found.values()])
    scored = _score_rows(
        step, batch, rows, [task for task, (idx, _) in found.items() for _ in range(len(idx))]
    )
    losses, stats_out, offset = {}, {}, 0
    for task, (idx, share) in found.items():
        here = slice(offset, offset + len(idx))
        offset += len(idx)
        logprobs = scored.logprobs[here].float()
        old = batch.old_logprobs[idx] if batch.old_logprobs is not None else logprobs.detach()
        ref = batch.ref_logprobs[idx] if batch.ref_logprobs is not None else None
        terms, stats = policy_loss_terms(
            logprobs,
            old,
            ref,
            batch.advantages[idx],
            batch.completion_mask[idx],
            scored.entropy[here].float(),
            epsilon_low=loss_cfg.epsilon_low,
            epsilon_high=loss_cfg.epsilon_high,
            loss_type=loss_cfg.loss_type,
            max_completion_length=step.cfg.grpo.sampling.max_new_tokens,
            token_weights=None if batch.is_weights is None else batch.is_weights[idx],
        )
        losses[task] = LossTerms(*(term * share for term in terms))
        # The statistics are token means over this part: weighted by its share of the task's tokens
        # over all processes, they add up to the token mean of the global batch however it is split.
        token_share = (
            float(batch.completion_mask[idx].sum()) / max(totals.tokens[task], 1.0) if share else 0.0
        )
        stats_out[task] = {
            key: token_share * float(value) for key, value in (stats | scored.logits_stats).items()
        }
    return losses, stats_out, PassPart(rows, scored.logprobs.detach().float(), scored.entropy.detach().float())


def _add_stats(into: dict[str, dict[str, float]], stats: dict[str, dict[str, float]]) -> None:
    for task, values in stats.items():
        acc = into.setdefault(task, {})
        for key, value in values.items():
            acc[key] = acc.get(key, 0.0) + value


class Gradient(NamedTuple):
    """One pass over the batch: the update direction, its statistics, and what the policy scored."""

    direction: torch.Tensor  # [P] the combined gradient (before clipping)
    stats: dict[str, Any]  # combination statistics and loss/<task>
    task_stats: dict[
        str, dict[str, float]
    ]  # per-task loss and logits statistics (shares of the task's tokens)
    scored: list[PassPart]  # the policy pass, part by part


def gradient(step: Step, batch: ScoredBatch, totals: Totals) -> Gradient:
    """The update direction ``[P]`` of one pass over the batch, its combination statistics, the per-task
    statistics and the pass: every part scored, then one backward of the summed loss (``summed_gradient``,
    ``Step.summed``) or each task's gradient combined (``combined_gradient``). I7: every loss goes through
    ``total_loss``."""
    return (summed_gradient if step.summed else combined_gradient)(step, batch, totals)


def summed_gradient(step: Step, batch: ScoredBatch, totals: Totals) -> Gradient:
    """``sum`` mode without per-task statistics: the gradient of the summed loss, one backward per part
    (the sum of the task gradients, the loss being linear), summed over processes."""
    loss_cfg, params, space = step.cfg.grpo.loss, step.params, step.space
    task_stats: dict[str, dict[str, float]] = {}
    scored: list[PassPart] = []
    direction, losses = space.zeros(params), {}
    for subset, micro in parts(step):
        by_task, stats, seen = task_losses(step, batch, totals, subset, micro)
        _add_stats(task_stats, stats)
        if not by_task:
            continue
        scored.append(seen)
        totals_here = {
            task: total_loss(terms, loss_cfg.beta, loss_cfg.entropy_coef) for task, terms in by_task.items()
        }
        direction += space.flat_grad(sum(totals_here.values()), params, retain=False)
        for task, value in totals_here.items():
            losses[task] = losses.get(task, 0.0) + float(value.detach())
        del by_task, totals_here
    direction = collectives.sum_gradient(step.accelerator, space, direction)
    bad = sorted(task for task, value in losses.items() if not math.isfinite(value)) or sorted(losses)
    check_finite(direction, f"the summed loss (task(s) {bad})", space)
    combined: dict[str, Any] = {f"loss/{task}": value for task, value in losses.items()}
    return Gradient(direction, combined | {"multitask/tasks_combined": float(len(losses))}, task_stats, scored)


def combined_gradient(step: Step, batch: ScoredBatch, totals: Totals) -> Gradient:
    """Each task's gradient from its own loss terms, summed over micro-batches and then over processes,
    combined once in the configured mode (``grpo.multitask``: sum, PCGrad or CAGrad; ``core.multitask``)."""
    mt, loss_cfg = step.cfg.grpo.multitask, step.cfg.grpo.loss
    params, space = step.params, step.space
    task_stats: dict[str, dict[str, float]] = {}
    scored: list[PassPart] = []
    grads: dict[str, TaskGradients] = {}
    for subset, micro in parts(step):
        by_task, stats, seen = task_losses(step, batch, totals, subset, micro)
        _add_stats(task_stats, stats)
        scored += [seen] if seen is not None else []
        for task in subset:
            if task in by_task:
                retain = not mt.low_memory and task != subset[-1]
                taken = task_gradient(
                    params, by_task[task], loss_cfg.beta, loss_cfg.entropy_coef, mt.reward_only, retain, space
                )
                accumulate(grads, task, taken)
        del by_task
    zeros = space.zeros(params)
    summed = collectives.sum_task_gradients(step.accelerator, space, grads, TASKS, zeros, mt.reward_only)
    direction, stats = combine_task_gradients(
        summed, TASKS, zeros, mode=mt.mode, c=mt.cagrad_c, rescale=mt.cagrad_rescale, space=space
    )
    stats |= {f"loss/{task}": g.loss for task, g in grads.items()}  # this process's: summed in ``update``
    return Gradient(direction, stats, task_stats, scored)


def update(
    step: Step, batch: ScoredBatch, check: Callable[[PolicyPass], dict[str, float]] | None = None
) -> tuple[dict[str, Any], PolicyPass]:
    """``num_iterations`` clipped optimizer steps on the combined per-task gradients: the last one's
    metrics, and what the first one's policy pass scored. ``check``: run on that first pass before the
    optimizer moves any weight (``agreement.step_checks``: it raises to stop the step); its statistics join
    the metrics."""
    params, space = step.params, step.space
    totals = global_totals(step, batch)
    metrics: dict[str, Any] = {}
    first: PolicyPass | None = None
    checked: dict[str, float] = {}
    for _ in range(step.cfg.grpo.num_iterations):
        step.optimizer.zero_grad(set_to_none=True)
        taken = gradient(step, batch, totals)
        if first is None:
            first = policy_pass(batch, taken.scored)
            checked = check(first) if check is not None else {}
        space.write(params, taken.direction)
        losses = {k: v for k, v in taken.stats.items() if k.startswith("loss/")}
        task_stats, losses = collectives.sum_task_statistics(step.accelerator, taken.task_stats, losses)
        mt_stats = {k: v for k, v in taken.stats.items() if not k.startswith("loss/")} | losses
        grad_norm = space.clip(params, step.cfg.grpo.max_grad_norm)
        if not math.isfinite(grad_norm):
            step.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"grpo: gradient norm is {grad_norm}; nothing was updated")
        if grad_norm > 0:  # a zero gradient makes no step: Adam's momentum must not drift in a deadlock
            step.optimizer.step()
        metrics = {**token_means(task_stats, totals), **mt_stats, "grad_norm": grad_norm, **checked}
    with warnings.catch_warnings():  # the step may have been skipped on purpose (zero gradient)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        step.scheduler.step()
    metrics["loss"] = sum(v for k, v in metrics.items() if k.startswith("loss/"))
    metrics["lr"] = step.scheduler.get_last_lr()[0]
    return metrics, first


class PolicyPass(NamedTuple):
    """A whole policy pass of the update in row order, made of its parts (``PassPart``): the log-probs and
    entropy it scored, detached, [N, C] each, 0 on rows it did not score. The first pass is what the step's
    checks hold to the sampler (``agreement.step_checks``) and what the step's trace keeps."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


def policy_pass(batch: ScoredBatch, scored: list[PassPart]) -> PolicyPass:
    """The parts of a pass put back in row order."""
    logprobs = torch.zeros(batch.completion_mask.shape, device=batch.completion_mask.device)
    entropy = torch.zeros_like(logprobs)
    for part in scored:
        logprobs[part.rows], entropy[part.rows] = part.logprobs, part.entropy
    return PolicyPass(logprobs, entropy)


def token_means(task_stats: dict[str, dict[str, float]], totals: Totals) -> dict[str, float]:
    """Token mean over both tasks (global tokens) of the per-task loss and logits statistics."""
    total = sum(totals.tokens[t] for t in task_stats) or 1.0
    keys = set().union(*(s.keys() for s in task_stats.values())) if task_stats else set()
    return {
        key: sum(s.get(key, 0.0) * totals.tokens[t] for t, s in task_stats.items()) / total for key in keys
    }
