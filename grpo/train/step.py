"""One GRPO step: rollout -> rewards -> advantages -> per-task losses -> combined update.

Kept apart from the loop (``trainer.py``) so the step is testable on its own: it takes a context of
model, optimizer and config, a list of records, and returns the step's metrics.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.core.advantages import group_advantages, per_row
from grpo.core.attention import takes_prepared_mask
from grpo.core.losses import LossTerms, policy_loss_terms
from grpo.core.multitask import TaskLoss, multitask_backward
from grpo.core.prefix import PromptPrefill
from grpo.core.timing import PhaseTimer, untimed
from grpo.data.prompts import example_messages
from grpo.data.schema import TASKS
from grpo.errors import GrpoError
from grpo.health.metrics import completion_stats, merge_process_metrics, task_reward_stats
from grpo.model.chat import render_prompt
from grpo.model.engines import HFEngine, RolloutEngine
from grpo.model.precision import bf16_autocast, has_dropout
from grpo.model.scoring import RolloutInputs, rollout_inputs, score_inputs, score_reference
from grpo.rewards import group_rewards
from grpo.seeding import derive_seed
from grpo.train.dynamic_sampling import Draw, MoreRecordsFn, sample_groups
from grpo.train.mismatch import sampler_correction
from grpo.train.sharding import gathered, grad_space


class NonFiniteError(GrpoError):
    """A reward, loss or gradient is NaN/Inf; the step is abandoned before anything is updated."""


@dataclass
class StepContext:
    """What a step reads and updates; built once per run by the trainer."""

    cfg: Config
    model: torch.nn.Module
    """The policy: a peft-wrapped model (LoRA) or the whole model (full fine-tuning)."""
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    eos_ids: list[int]
    accelerator: Accelerator
    reference: torch.nn.Module | None = None
    """The frozen SFT model (full fine-tuning), or None: the policy with its adapter disabled (I9)."""
    engine: RolloutEngine | None = None
    """What samples the completions (``grpo/model/engines.py``); None: the decode loop on ``model``."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward passes' precision (``grpo.bf16``): bf16 autocast over fp32 weights where it pays."""
        return bf16_autocast(self.accelerator.device, self.cfg.grpo.bf16)


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, Any]
    raw_texts: list[str]  # completions with their special tokens (for the boundary monitor)
    prompt_texts: list[str]  # the user message of each completion's prompt
    header_tokens: list[str]
    end_of_turn_tokens: list[str]


@dataclass(frozen=True)
class ScoredBatch:
    """A rollout joined into model inputs, with the stored log-probs the loss compares against."""

    inputs: RolloutInputs  # ids [N, P+C], masks, and the temperature the rollout sampled at (I10)
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None  # [N, C]; None: the current (detached) log-probs, ratio == 1
    ref_logprobs: torch.Tensor | None  # [N, C]; None when beta == 0
    rows: dict[str, torch.Tensor]  # task -> row indices [n_task], only tasks with rows
    is_weights: torch.Tensor | None = None  # [N, C] truncated IS weights; None when the trainer sampled
    prefills: tuple[PromptPrefill, ...] = ()  # the rollout's prefill kept for the policy pass (``reuses_prefill``)

    @property
    def completion_mask(self) -> torch.Tensor:  # [N, C] bool
        return self.inputs.completion_mask


@dataclass(frozen=True)
class Totals:
    """Rows and completion tokens of each task over ALL processes: the denominators of each task's
    loss, so the processes' losses (and gradients) summed are the one-process ones of the global batch."""

    rows: dict[str, float]
    tokens: dict[str, float]


def header_tokens(tokenizer, eos_ids: Sequence[int]) -> list[str]:
    """Special tokens that must never appear inside a completion (chat headers, BOS, role tags)."""
    allowed = set(eos_ids) | {tokenizer.pad_token_id}
    return sorted(
        tok.content for idx, tok in tokenizer.added_tokens_decoder.items() if tok.special and idx not in allowed
    )


def row_tasks(records: Sequence[dict], group_size: int) -> list[str]:
    """The task of every rollout row: row ``i`` answers ``records[i // group_size]`` -> [N]."""
    return per_row([record["task"] for record in records], group_size)


def draw(ctx: StepContext, records: list[dict], seed: int, timer: Callable = untimed) -> Draw:
    """Roll out G completions per record and score them: rewards, then group advantages."""
    cfg = ctx.cfg
    prompts = [render_prompt(ctx.tokenizer, example_messages(r), **cfg.model.chat_template_kwargs)
               for r in records]
    engine = ctx.engine or HFEngine(ctx.model, ctx.tokenizer, shared_prefill=cfg.grpo.shared_prefix)
    keep = {"keep_segments": [r["task"] for r in records]} if reuses_prefill(ctx) else {}
    with timer("generate"), ctx.autocast():
        sampled = engine.generate(prompts, cfg.grpo.group_size, cfg.grpo.sampling, ctx.eos_ids, seed, **keep)
    rollout, group = sampled.rollout, cfg.grpo.group_size
    with timer("reward"):
        rewards = torch.tensor(group_rewards(rollout.texts, records, group, cfg.rewards.weights))
        advantages, stats = step_advantages(ctx.accelerator, rewards, group, cfg.grpo.loss.scale_rewards,
                                            together=cfg.grpo.dynamic_sampling != "resample")
    weights = None
    if sampled.sampler_logprobs is not None:  # another engine sampled: measure and correct the mismatch
        with ctx.autocast():  # in the loss's precision (grpo.bf16), so the weights correct only the engine
            correction, weights = sampler_correction(ctx.model, rollout, sampled.sampler_logprobs,
                                                     rollout.temperature, cfg.grpo.rollout)
        stats |= correction
    tasks = row_tasks(records, group)
    return Draw(rollout, list(records), rewards, advantages, stats | task_reward_stats(rewards, tasks), weights,
                sampled.prefills)


def step_advantages(accelerator: Accelerator, rewards: torch.Tensor, group_size: int,
                    scale_rewards: str, together: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """Group advantages of this process's rows -> ``(advantages [N], stats)``. A group never spans
    processes, so only ``batch`` scaling needs the others: its std is the global batch's (from the
    processes' summed count, sum and sum of squares), as one process drawing every prompt would use.
    ``together``: every process draws the same number of times (not so under dynamic resampling, whose
    extra draws are each process's own: there the std stays the process's, as no collective may wait)."""
    if scale_rewards != "batch" or accelerator.num_processes == 1 or not together:
        return group_advantages(rewards, group_size, scale_rewards)
    r = rewards.double()
    totals = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()])
    n, total, squares = accelerator.reduce(totals.to(accelerator.device), "sum").cpu().tolist()
    variance = (squares - total * total / n) / (n - 1) if n > 1 else 0.0
    return group_advantages(rewards, group_size, scale_rewards, batch_std=max(variance, 0.0) ** 0.5)


def reuses_prefill(ctx: StepContext) -> bool:
    """Whether the update's policy pass may reuse the rollout's prefill (``core.prefix.PromptPrefill``):
    only where a fresh pass would be the very same computation and each prompt's graph is traversed by
    the backward of its own task once. So: the trainer's model samples (the hf engine), one optimizer
    step on one micro-batch per rollout (the weights are the rollout's), the rollout's groups trained as
    drawn (dynamic sampling's selections drop the kept prefill), one process (DDP and FSDP wrap
    the forward the update runs), a full-attention model that takes the prepared 4D mask, the prompt
    scored once (``shares_prefix``: no gradient checkpointing), and no dropout (the rollout runs in
    eval mode, the update in train mode)."""
    cfg, model = ctx.cfg.grpo, ctx.model
    return (shares_prefix(ctx) and cfg.reuse_prefill and (ctx.engine is None or isinstance(ctx.engine, HFEngine))
            and cfg.num_iterations == 1 and cfg.grad_accum == 1 and cfg.dynamic_sampling == "none"
            and ctx.accelerator.num_processes == 1
            and not grad_space(model, ctx.accelerator).sharded and takes_prepared_mask(model)
            and not has_dropout(model))


def shares_prefix(ctx: StepContext) -> bool:
    """Whether the step scores each prompt once for its group (``grpo.shared_prefix``). Not under gradient
    checkpointing: its layers return no key/value cache in train mode, and the completions' pass reads
    the prompt's from the cache. The step then scores whole sequences, the same log-probs."""
    return ctx.cfg.grpo.shared_prefix and not getattr(ctx.model, "is_gradient_checkpointing", False)


def _stored_logprobs(ctx: StepContext, inputs: RolloutInputs, adapter: bool) -> torch.Tensor:
    """Log-probs kept fixed through the update: the old policy's, or the reference's (adapter off, I9)."""
    with torch.no_grad(), ctx.autocast():
        shared = shares_prefix(ctx)
        if not adapter:  # I9: the frozen SFT copy (full fine-tuning) or the adapter disabled (LoRA)
            return score_reference(ctx.model, inputs, ctx.reference, shared_prefix=shared).logprobs.float()
        return score_inputs(ctx.model, inputs, shared_prefix=shared).logprobs.float()


def prepare_batch(ctx: StepContext, sampled: Draw) -> ScoredBatch:
    """Join prompt and generated ids (I3) and compute the stored old and reference log-probs, all
    under the temperature the rollout recorded (I10): the same distribution the update scores."""
    rollout, device = sampled.rollout, ctx.accelerator.device
    inputs = rollout_inputs(rollout, device)
    old = _stored_logprobs(ctx, inputs, adapter=True) if ctx.cfg.grpo.num_iterations > 1 else None
    ref = _stored_logprobs(ctx, inputs, adapter=False) if ctx.cfg.grpo.loss.beta > 0 else None
    tasks = row_tasks(sampled.records, rollout.group_size)
    rows = {t: torch.tensor([i for i, x in enumerate(tasks) if x == t], dtype=torch.long, device=device)
            for t in TASKS}
    weights = None if sampled.is_weights is None else sampled.is_weights.to(device)
    return ScoredBatch(inputs, sampled.advantages.to(device), old, ref, {t: r for t, r in rows.items() if len(r)},
                       weights, sampled.prefills if reuses_prefill(ctx) else ())


def global_totals(ctx: StepContext, batch: ScoredBatch) -> Totals:
    """Each task's rows and completion tokens, summed over the processes (one small all-reduce)."""
    local = torch.tensor([[float(len(batch.rows[t])), float(batch.completion_mask[batch.rows[t]].sum())]
                          if t in batch.rows else [0.0, 0.0] for t in TASKS], dtype=torch.float64)  # [K, 2]
    if ctx.accelerator.num_processes > 1:
        local = ctx.accelerator.reduce(local.to(ctx.accelerator.device), "sum").cpu()
    return Totals({t: float(local[i, 0]) for i, t in enumerate(TASKS)},
                  {t: float(local[i, 1]) for i, t in enumerate(TASKS)})


def _micro_rows(batch: ScoredBatch, totals: Totals, task: str, micro: int, n_micro: int,
                loss_type: str) -> tuple[torch.Tensor, float]:
    """Rows of ``task`` in micro-batch ``micro`` and their share of the task's loss over the GLOBAL
    batch (rows, or tokens for token_mean), so the gradients summed over micro-batches and processes
    equal the one-process gradient of the whole batch, however the rows are spread."""
    part = torch.tensor_split(batch.rows[task], n_micro)[micro]
    if loss_type == "token_mean":
        share = float(batch.completion_mask[part].sum()) / max(totals.tokens[task], 1.0)
    else:
        share = len(part) / totals.rows[task]
    return part, share


def _task_losses(ctx: StepContext, batch: ScoredBatch, totals: Totals, subset: tuple[str, ...], micro: int,
                 stats_out: dict[str, dict[str, float]]) -> dict[str, TaskLoss]:
    """One forward over micro-batch ``micro`` of the rows of ``subset``; each task's terms from its rows.
    Under FSDP a task without rows here gets a zero-weighted loss on one row: every process must run
    the same forwards and backwards, each is a collective there."""
    loss_cfg, n_micro = ctx.cfg.grpo.loss, ctx.cfg.grpo.grad_accum
    parts = {t: _micro_rows(batch, totals, t, micro, n_micro, loss_cfg.loss_type) for t in subset if t in batch.rows}
    parts = {t: p for t, p in parts.items() if len(p[0])}
    if grad_space(ctx.model, ctx.accelerator).sharded:
        placeholder = torch.zeros(1, dtype=torch.long, device=batch.advantages.device)
        parts = {t: parts.get(t, (placeholder, 0.0)) for t in subset}
    if not parts:
        return {}
    rows = torch.cat([p[0] for p in parts.values()])
    with ctx.autocast():
        scored = score_inputs(ctx.model, batch.inputs.rows(rows), shared_prefix=shares_prefix(ctx),
                              prefills=batch.prefills)
    out, offset = {}, 0
    for task, (idx, share) in parts.items():
        here = slice(offset, offset + len(idx))
        offset += len(idx)
        logprobs = scored.logprobs[here].float()
        old = batch.old_logprobs[idx] if batch.old_logprobs is not None else logprobs.detach()
        ref = batch.ref_logprobs[idx] if batch.ref_logprobs is not None else None
        terms, stats = policy_loss_terms(
            logprobs, old, ref, batch.advantages[idx], batch.completion_mask[idx], scored.entropy[here].float(),
            epsilon_low=loss_cfg.epsilon_low, epsilon_high=loss_cfg.epsilon_high,
            loss_type=loss_cfg.loss_type, max_completion_length=ctx.cfg.grpo.sampling.max_new_tokens,
            token_weights=None if batch.is_weights is None else batch.is_weights[idx],
        )
        out[task] = TaskLoss(LossTerms(*(term * share for term in terms)))
        # The statistics are token means over this part: weighted by its share of the task's tokens
        # over all processes, they add up to the token mean of the global batch however it is split.
        token_share = float(batch.completion_mask[idx].sum()) / max(totals.tokens[task], 1.0) if share else 0.0
        acc = stats_out.setdefault(task, {})
        for key, value in (stats | scored.logits_stats).items():
            acc[key] = acc.get(key, 0.0) + token_share * float(value)
    return out


def update(ctx: StepContext, batch: ScoredBatch) -> dict[str, Any]:
    """``num_iterations`` clipped optimizer steps on the combined per-task gradients."""
    mt, loss_cfg = ctx.cfg.grpo.multitask, ctx.cfg.grpo.loss
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    totals = global_totals(ctx, batch)
    # Each process's losses are already scaled by their share of the global batch: the SUM over
    # processes of its per-task gradients is the one-process gradient. Sharded (FSDP), the
    # reduce-scatter of backward already sums them.
    space = grad_space(ctx.model, ctx.accelerator)
    replicated = ctx.accelerator.num_processes > 1 and not space.sharded
    reduce_fn = (lambda g: ctx.accelerator.reduce(g, "sum")) if replicated else None
    metrics: dict[str, Any] = {}
    for _ in range(ctx.cfg.grpo.num_iterations):
        task_stats: dict[str, dict[str, float]] = {}
        ctx.optimizer.zero_grad(set_to_none=True)
        mt_stats = multitask_backward(
            params, lambda subset, micro, out=task_stats: _task_losses(ctx, batch, totals, subset, micro, out),
            TASKS,  # every process passes every task: the per-task all-reduce calls must match
            mode=mt.mode, c=mt.cagrad_c, rescale=mt.cagrad_rescale, reward_only=mt.reward_only,
            low_memory=mt.low_memory, beta=loss_cfg.beta, entropy_coef=loss_cfg.entropy_coef,
            reduce_fn=reduce_fn, micro_batches=ctx.cfg.grpo.grad_accum, task_stats=mt.task_stats, space=space,
        )
        task_stats, mt_stats = _sum_over_processes(ctx, task_stats, mt_stats)
        grad_norm = space.clip(params, ctx.cfg.grpo.max_grad_norm)
        if not math.isfinite(grad_norm):
            ctx.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"grpo: gradient norm is {grad_norm}; nothing was updated")
        if grad_norm > 0:  # a zero gradient makes no step: Adam's momentum must not drift in a deadlock
            ctx.optimizer.step()
        metrics = {**_mean_stats(task_stats, totals), **mt_stats, "grad_norm": grad_norm}
    with warnings.catch_warnings():  # the step may have been skipped on purpose (zero gradient)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        ctx.scheduler.step()
    metrics["loss"] = sum(v for k, v in metrics.items() if k.startswith("loss/"))
    metrics["lr"] = ctx.scheduler.get_last_lr()[0]
    return metrics


def _sum_over_processes(ctx: StepContext, task_stats: dict[str, dict[str, float]],
                        mt_stats: dict[str, Any]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Per-task statistics and ``loss/<task>`` summed over processes: each process's values are
    already weighted by its share of the global batch (``_micro_rows``), so the sum is the global one."""
    if ctx.accelerator.num_processes == 1:
        return task_stats, mt_stats
    losses = {k: v for k, v in mt_stats.items() if k.startswith("loss/")}
    summed_stats: dict[str, dict[str, float]] = {}
    summed_losses: dict[str, float] = {}
    for stats, loss in gather_object([(task_stats, losses)]):
        for task, values in stats.items():
            acc = summed_stats.setdefault(task, {})
            for key, value in values.items():
                acc[key] = acc.get(key, 0.0) + value
        for key, value in loss.items():
            summed_losses[key] = summed_losses.get(key, 0.0) + value
    return summed_stats, {k: v for k, v in mt_stats.items() if not k.startswith("loss/")} | summed_losses


def _mean_stats(task_stats: dict[str, dict[str, float]], totals: Totals) -> dict[str, float]:
    """Token mean over both tasks (global tokens) of the per-task loss and logits statistics."""
    total = sum(totals.tokens[t] for t in task_stats) or 1.0
    keys = set().union(*(s.keys() for s in task_stats.values())) if task_stats else set()
    return {key: sum(s.get(key, 0.0) * totals.tokens[t] for t, s in task_stats.items()) / total
            for key in keys}


def grpo_step(ctx: StepContext, records: list[dict], step: int,
              more_records: MoreRecordsFn) -> StepResult:
    """Everything one step does; ``records`` are this process's prompts, ``more_records(attempt)``
    fresh ones for dynamic resampling. The result describes the global batch (all processes)."""
    started, timer = time.perf_counter(), PhaseTimer()
    cfg = ctx.cfg
    def seeded_draw(recs: list[dict], attempt: int) -> Draw:
        return draw(ctx, recs, derive_seed(cfg.seed, ("step", step), ("process", ctx.accelerator.process_index),
                                           ("attempt", attempt)), timer)

    with gathered(ctx.model):  # FSDP: whole weights for the rollout, no collective per generated token
        sampled, sample_stats = sample_groups(seeded_draw, records, more_records,
            cfg.grpo.dynamic_sampling, cfg.grpo.max_resample, ctx.tokenizer.pad_token_id)
    raise_on_nonfinite_rewards(ctx.accelerator, sampled.rewards, row_tasks(sampled.records, sampled.rollout.group_size),
                               step)
    with timer("reference"):
        batch = prepare_batch(ctx, sampled)
    with timer("update"):
        update_stats = update(ctx, batch)
    return step_result(ctx, records, sampled, sample_stats, update_stats, time.perf_counter() - started, timer)


def raise_on_nonfinite_rewards(accelerator: Accelerator, rewards: torch.Tensor, tasks: Sequence[str], step: int) -> None:
    """NonFiniteError on EVERY process when any process has a NaN/Inf reward (``rewards`` [N], ``tasks``
    the task of each row): a process that raised alone would leave the others in the next all-reduce."""
    bad = sorted({tasks[i] for i in torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()})
    anywhere = float(len(bad))
    if accelerator.num_processes > 1:
        anywhere = float(accelerator.reduce(torch.tensor([anywhere], device=accelerator.device), "sum"))
    if anywhere:
        where = f"for task(s) {bad}" if bad else "on another process"
        raise NonFiniteError(f"grpo: NaN/Inf reward at step {step} {where}; "
                             "check that task's reward function and rewards.weights")


def step_result(ctx: StepContext, records: Sequence[dict], sampled: Draw, sample_stats: dict[str, float],
                update_stats: dict[str, Any], elapsed: float, timer: PhaseTimer | None = None) -> StepResult:
    """The step's metrics and completions; ``records`` are the prompts of the first draw; ``timer`` the
    seconds of each phase of the step."""
    rollout, g = sampled.rollout, sampled.rollout.group_size
    metrics = {
        **sample_stats,  # reward statistics of the first draw: filtering must not hide a deadlock
        **completion_stats(rollout.lengths, rollout.truncated),
        **update_stats,
        "policy/entropy": update_stats["entropy"],
        "eos_suppressed_frac": rollout.eos_suppressed_frac,
        "step_time": elapsed,
        "tokens_per_s": float(rollout.lengths.sum()) / max(elapsed, 1e-9),
        **(timer.metrics(elapsed) if timer is not None else {}),
    }
    user_texts = [example_messages(r)[-1]["content"] for r in sampled.records]
    result = StepResult(metrics, rollout.raw_texts, per_row(user_texts, g),
                        header_tokens(ctx.tokenizer, ctx.eos_ids), ctx.tokenizer.convert_ids_to_tokens(ctx.eos_ids))
    counts = {"groups": float(len(records)), "rows": float(len(rollout.raw_texts)),
              **{f"rows/{t}": float(g * sum(r["task"] == t for r in records)) for t in TASKS}}
    return global_result(ctx.accelerator, result, counts)


def global_result(accelerator: Accelerator, local: StepResult, counts: dict[str, float]) -> StepResult:
    """``local`` merged over all processes (metrics of the global batch, every completion), the same
    on every process, so the monitor decides the same everywhere and every process stops together.
    ``counts``: this process's ``groups``, ``rows`` and ``rows/<task>`` (see ``merge_process_metrics``)."""
    if accelerator.num_processes == 1:
        return local
    parts = gather_object([(local.metrics, counts, local.raw_texts, local.prompt_texts)])
    return StepResult(merge_process_metrics([p[0] for p in parts], [p[1] for p in parts]),
                      [text for p in parts for text in p[2]], [text for p in parts for text in p[3]],
                      local.header_tokens, local.end_of_turn_tokens)
