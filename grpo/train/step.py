"""One GRPO step: rollout -> rewards -> advantages -> per-task losses -> combined update.

Kept apart from the loop (``trainer.py``) so the step is testable on its own: it takes a context of
model, optimizer and config, a list of records, and returns the step's metrics.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.core.advantages import group_advantages, per_row
from grpo.core.batching import join_prompt_completion
from grpo.core.logprobs import score_completions
from grpo.core.losses import LossTerms, policy_loss_terms
from grpo.core.multitask import TaskLoss, multitask_backward
from grpo.data.prompts import example_messages
from grpo.data.schema import TASKS
from grpo.errors import GrpoError
from grpo.health.metrics import completion_stats, task_reward_stats
from grpo.model.chat import render_prompt
from grpo.model.rollout import generate_rollout
from grpo.rewards import group_rewards
from grpo.seeding import derive_seed
from grpo.train.dynamic_sampling import Draw, MoreRecordsFn, sample_groups


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

    input_ids: torch.Tensor  # [N, P+C]
    attention_mask: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, C] bool
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None  # [N, C]; None: the current (detached) log-probs, ratio == 1
    ref_logprobs: torch.Tensor | None  # [N, C]; None when beta == 0
    rows: dict[str, torch.Tensor]  # task -> row indices [n_task], only tasks with rows


def header_tokens(tokenizer, eos_ids: Sequence[int]) -> list[str]:
    """Special tokens that must never appear inside a completion (chat headers, BOS, role tags)."""
    allowed = set(eos_ids) | {tokenizer.pad_token_id}
    return sorted(
        tok.content for idx, tok in tokenizer.added_tokens_decoder.items() if tok.special and idx not in allowed
    )


def row_tasks(records: Sequence[dict], group_size: int) -> list[str]:
    """The task of every rollout row: row ``i`` answers ``records[i // group_size]`` -> [N]."""
    return per_row([record["task"] for record in records], group_size)


def draw(ctx: StepContext, records: list[dict], seed: int) -> Draw:
    """Roll out G completions per record and score them: rewards, then group advantages."""
    cfg = ctx.cfg
    prompts = [render_prompt(ctx.tokenizer, example_messages(r), **cfg.model.chat_template_kwargs)
               for r in records]
    rollout = generate_rollout(ctx.model, ctx.tokenizer, prompts, cfg.grpo.group_size, cfg.grpo.sampling,
                               ctx.eos_ids, seed)
    group = cfg.grpo.group_size
    rewards = torch.tensor(group_rewards(rollout.texts, records, group, cfg.rewards.weights))
    advantages, stats = group_advantages(rewards, group, cfg.grpo.loss.scale_rewards)
    tasks = row_tasks(records, group)
    return Draw(rollout, list(records), rewards, advantages, stats | task_reward_stats(rewards, tasks))


def _score(ctx: StepContext, input_ids, attention_mask, width: int, adapter: bool) -> torch.Tensor:
    temperature = ctx.cfg.grpo.sampling.temperature
    with torch.no_grad(), ctx.accelerator.autocast():
        if adapter:
            return score_completions(ctx.model, input_ids, attention_mask, width, temperature).logprobs.float()
        if ctx.reference is not None:  # I9 under full fine-tuning: the frozen SFT weights
            return score_completions(ctx.reference, input_ids, attention_mask, width, temperature).logprobs.float()
        with ctx.model.disable_adapter():  # I9: the reference is the SFT policy itself
            return score_completions(ctx.model, input_ids, attention_mask, width, temperature).logprobs.float()


def prepare_batch(ctx: StepContext, sampled: Draw) -> ScoredBatch:
    """Join prompt and completion ids (I3) and compute the stored old and reference log-probs."""
    rollout, device = sampled.rollout, ctx.accelerator.device
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    input_ids, attention_mask = joined.input_ids.to(device), joined.attention_mask.to(device)
    width = rollout.completion_ids.shape[1]
    old = _score(ctx, input_ids, attention_mask, width, adapter=True) if ctx.cfg.grpo.num_iterations > 1 else None
    ref = _score(ctx, input_ids, attention_mask, width, adapter=False) if ctx.cfg.grpo.loss.beta > 0 else None
    tasks = row_tasks(sampled.records, rollout.group_size)
    rows = {t: torch.tensor([i for i, x in enumerate(tasks) if x == t], dtype=torch.long, device=device)
            for t in TASKS}
    return ScoredBatch(input_ids, attention_mask, rollout.completion_mask.to(device),
                       sampled.advantages.to(device), old, ref, {t: r for t, r in rows.items() if len(r)})


def _micro_rows(batch: ScoredBatch, task: str, micro: int, n_micro: int, loss_type: str) -> tuple[torch.Tensor, float]:
    """Rows of ``task`` in micro-batch ``micro`` and their share of the task's loss (rows, or tokens
    for token_mean), so the summed micro-batch gradients equal the whole batch's."""
    rows = batch.rows[task]
    part = torch.tensor_split(rows, n_micro)[micro]
    if loss_type == "token_mean":
        share = float(batch.completion_mask[part].sum()) / max(float(batch.completion_mask[rows].sum()), 1.0)
    else:
        share = len(part) / len(rows)
    return part, share


def _task_losses(ctx: StepContext, batch: ScoredBatch, subset: tuple[str, ...], micro: int,
                 stats_out: dict[str, dict[str, float]]) -> dict[str, TaskLoss]:
    """One forward over micro-batch ``micro`` of the rows of ``subset``; each task's terms from its rows."""
    loss_cfg, n_micro = ctx.cfg.grpo.loss, ctx.cfg.grpo.grad_accum
    parts = {t: _micro_rows(batch, t, micro, n_micro, loss_cfg.loss_type) for t in subset if t in batch.rows}
    parts = {t: p for t, p in parts.items() if len(p[0])}
    if not parts:
        return {}
    rows = torch.cat([p[0] for p in parts.values()])
    width = batch.completion_mask.shape[1]
    with ctx.accelerator.autocast():
        scored = score_completions(ctx.model, batch.input_ids[rows], batch.attention_mask[rows], width,
                                   ctx.cfg.grpo.sampling.temperature)
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
        )
        out[task] = TaskLoss(LossTerms(*(term * share for term in terms)))
        acc = stats_out.setdefault(task, {})
        for key, value in (stats | scored.logits_stats).items():
            acc[key] = acc.get(key, 0.0) + share * float(value)
    return out


def update(ctx: StepContext, batch: ScoredBatch) -> dict[str, Any]:
    """``num_iterations`` clipped optimizer steps on the combined per-task gradients."""
    mt, loss_cfg = ctx.cfg.grpo.multitask, ctx.cfg.grpo.loss
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    reduce_fn = (lambda g: ctx.accelerator.reduce(g, "mean")) if ctx.accelerator.num_processes > 1 else None
    metrics: dict[str, Any] = {}
    for _ in range(ctx.cfg.grpo.num_iterations):
        task_stats: dict[str, dict[str, float]] = {}
        ctx.optimizer.zero_grad(set_to_none=True)
        mt_stats = multitask_backward(
            params, lambda subset, micro, out=task_stats: _task_losses(ctx, batch, subset, micro, out),
            TASKS,  # every process passes every task: the per-task all-reduce calls must match
            mode=mt.mode, c=mt.cagrad_c, rescale=mt.cagrad_rescale, reward_only=mt.reward_only,
            low_memory=mt.low_memory, beta=loss_cfg.beta, entropy_coef=loss_cfg.entropy_coef,
            reduce_fn=reduce_fn, micro_batches=ctx.cfg.grpo.grad_accum,
        )
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, ctx.cfg.grpo.max_grad_norm))
        if not math.isfinite(grad_norm):
            ctx.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"grpo: gradient norm is {grad_norm}; nothing was updated")
        if grad_norm > 0:  # a zero gradient makes no step: Adam's momentum must not drift in a deadlock
            ctx.optimizer.step()
        metrics = {**_mean_stats(task_stats, batch), **mt_stats, "grad_norm": grad_norm}
    with warnings.catch_warnings():  # the step may have been skipped on purpose (zero gradient)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        ctx.scheduler.step()
    metrics["loss"] = sum(v for k, v in metrics.items() if k.startswith("loss/"))
    metrics["lr"] = ctx.scheduler.get_last_lr()[0]
    return metrics


def _mean_stats(task_stats: dict[str, dict[str, float]], batch: ScoredBatch) -> dict[str, float]:
    """Row-weighted mean of the per-task loss and logits statistics."""
    total = sum(len(batch.rows[t]) for t in task_stats) or 1
    keys = set().union(*(s.keys() for s in task_stats.values())) if task_stats else set()
    return {key: sum(s.get(key, 0.0) * len(batch.rows[t]) for t, s in task_stats.items()) / total
            for key in keys}


def grpo_step(ctx: StepContext, records: list[dict], step: int,
              more_records: MoreRecordsFn) -> StepResult:
    """Everything one step does; ``records`` are this process's prompts, ``more_records(attempt)``
    fresh ones for dynamic resampling."""
    started = time.perf_counter()
    cfg = ctx.cfg
    def seeded_draw(recs: list[dict], attempt: int) -> Draw:
        return draw(ctx, recs, derive_seed(cfg.seed, ("step", step), ("process", ctx.accelerator.process_index),
                                           ("attempt", attempt)))

    sampled, sample_stats = sample_groups(seeded_draw, records, more_records,
        cfg.grpo.dynamic_sampling, cfg.grpo.max_resample, ctx.tokenizer.pad_token_id)
    rewards, rollout = sampled.rewards, sampled.rollout
    if not torch.isfinite(rewards).all():
        tasks = row_tasks(sampled.records, rollout.group_size)
        bad = [tasks[i] for i in torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()]
        raise NonFiniteError(f"grpo: NaN/Inf reward at step {step} for task(s) {sorted(set(bad))}; "
                             "check that task's reward function and rewards.weights")
    update_stats = update(ctx, prepare_batch(ctx, sampled))
    elapsed = time.perf_counter() - started
    metrics = {
        **sample_stats,  # reward statistics of the first draw: filtering must not hide a deadlock
        **completion_stats(rollout.lengths, rollout.truncated),
        **update_stats,
        "policy/entropy": update_stats["entropy"],
        "eos_suppressed_frac": rollout.eos_suppressed_frac,
        "step_time": elapsed,
        "tokens_per_s": float(rollout.lengths.sum()) / max(elapsed, 1e-9),
    }
    user_texts = [example_messages(r)[-1]["content"] for r in sampled.records]
    return StepResult(metrics, rollout.raw_texts, per_row(user_texts, rollout.group_size),
                      header_tokens(ctx.tokenizer, ctx.eos_ids),
                      ctx.tokenizer.convert_ids_to_tokens(ctx.eos_ids))
