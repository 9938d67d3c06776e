"""One GRPO step, top to bottom: rollout -> rewards -> advantages -> scoring -> loss -> gradient
combination -> optimizer.

``build_step`` makes the step's context (``Step``, defined with ``ScoredBatch`` in ``step_types.py``) once
per run, from the policy ``train.policy.build_policy`` made: the trainer and the pre-flight gate both call
it, so the gate checks the very step that trains.
``grpo_step`` then runs one step on a list of records: ``sample`` rolls out G completions per prompt
and scores them (rewards, group advantages; dynamic sampling draws again where it must),
``prepare_batch`` joins prompts and completions and stores the old and reference log-probs,
``update.update`` scores, takes the per-task gradients, combines them and steps the optimizer.
What several processes exchange is in ``collectives.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.core.advantages import group_advantages, per_row
from grpo.core.multitask import MultitaskError
from grpo.core.timing import PhaseTimer, untimed
from grpo.data.prompts import example_messages, render_records
from grpo.data.schema import TASKS
from grpo.health.kinds import kind_counts, kind_stats
from grpo.health.metrics import completion_stats, task_reward_stats
from grpo.model.engines import HFEngine, RolloutEngine, make_engine
from grpo.model.fast import FastPaths
from grpo.model.rollout import stop_ids
from grpo.model.scoring import rollout_inputs
from grpo.rewards import group_rewards
from grpo.seeding import derive_seed
from grpo.train import collectives
from grpo.train.agreement import StepInvariantError, step_checks
from grpo.train.dynamic_sampling import Draw, MoreRecordsFn, merge_draws
from grpo.train.mismatch import sampler_correction
from grpo.train.policy import Policy, build_policy
from grpo.train.sharding import gathered, grad_space
from grpo.train.step_types import ScoredBatch, Step
from grpo.train.update import NonFiniteError, PolicyPass, score_parts, update


def shares_prefix(cfg: Config, model: torch.nn.Module) -> bool:
    """Whether the step scores each prompt once for its group (``grpo.shared_prefix``). Not under gradient
    checkpointing: its layers return no key/value cache in train mode, and the completions' pass reads
    the prompt's from the cache. The step then scores whole sequences, the same log-probs."""
    return cfg.grpo.shared_prefix and not getattr(model, "is_gradient_checkpointing", False)


def header_tokens(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int]) -> list[str]:
    """Special tokens that must never appear inside a completion (chat headers, BOS, role tags)."""
    allowed = set(eos_ids) | {tokenizer.pad_token_id}
    return sorted(
        tok.content
        for idx, tok in tokenizer.added_tokens_decoder.items()
        if tok.special and idx not in allowed
    )


def build_step(
    cfg: Config, policy: Policy, accelerator: Accelerator, engine: RolloutEngine | None = None
) -> Step:
    """The step's context around the policy ``build_policy`` made: its stop ids, its rollout engine
    (``grpo.rollout.engine``'s unless another is given), its reference, and the facts every step uses.
    The one construction: the trainer and the gate call it."""
    model, tokenizer = policy.model, policy.tokenizer
    eos_ids = stop_ids(model, tokenizer, cfg.model.extra_stop_tokens)
    fast = FastPaths.resolve(cfg.model.fast_paths)
    if engine is None:
        engine = make_engine(
            cfg.grpo.rollout, model, tokenizer, seed=cfg.seed, shared_prefill=cfg.grpo.shared_prefix, fast=fast
        )
    one_process = accelerator.num_processes == 1 and not grad_space(model, accelerator).sharded
    return Step(
        cfg=cfg,
        model=model,
        tokenizer=tokenizer,
        optimizer=policy.optimizer,
        scheduler=policy.scheduler,
        eos_ids=eos_ids,
        accelerator=accelerator,
        engine=engine,
        reference=policy.reference,
        space=grad_space(model, accelerator),
        shares_prefix=shares_prefix(cfg, model),
        reuses_prefill=fast.reuses_prefill(
            cfg.grpo,
            model,
            shares_prefix=shares_prefix(cfg, model),
            samples_on_model=isinstance(engine, HFEngine),
            one_process=one_process,
        ),
        header_tokens=header_tokens(tokenizer, eos_ids),
        end_of_turn_tokens=tokenizer.convert_ids_to_tokens(eos_ids),
        fast=fast,
    )


def build_training(
    cfg: Config, accelerator: Accelerator, shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None
) -> Step:
    """What GRPO trains with: the policy on the SFT weights (``build_policy``; ``shard``: FSDP2) and the step
    around it (``build_step``). The trainer and the pre-flight gate both start here."""
    return build_step(cfg, build_policy(cfg, accelerator.device, shard=shard), accelerator)


@dataclass(frozen=True)
class StepTrace:
    """This process's share of every tensor that entered the step's loss, detached: the draw (records,
    rollout with the decode loop's sequences, the texts the rewards read, rewards, advantages), the
    joined batch with the stored old and reference log-probs, and the update's first policy pass. The
    pre-flight gate compares it with a reference step written apart (``grpo/checks/reference_step.py``)."""

    draw: Draw
    batch: ScoredBatch
    policy: PolicyPass


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, Any]
    raw_texts: list[str]  # completions with their special tokens (for the boundary monitor)
    prompt_texts: list[str]  # the user message of each completion's prompt
    header_tokens: list[str]
    end_of_turn_tokens: list[str]
    trace: StepTrace | None = None


# --------------------------------------------------------------------------- rollout, rewards, advantages


def draw(step: Step, records: list[dict], seed: int, timer: Callable = untimed) -> Draw:
    """Roll out G completions per record, then their rewards and group advantages."""
    cfg, group = step.cfg, step.cfg.grpo.group_size
    prompts = render_records(step.tokenizer, records, cfg.model.chat_template_kwargs)
    with timer("generate"), step.autocast():
        sampled = step.engine.generate(
            prompts, group, cfg.grpo.sampling, step.eos_ids, seed, **step.prefill_args(records)
        )
    rollout = sampled.rollout
    with timer("reward"):
        rewards = torch.tensor(group_rewards(rollout.texts, records, group, cfg.rewards))
        scale = cfg.grpo.loss.scale_rewards
        # A group never spans processes: only batch scaling needs the others, except under dynamic
        # resampling, whose extra draws are each process's own (no collective may wait for them).
        batch_std = (
            collectives.global_reward_std(step.accelerator, rewards)
            if scale == "batch"
            and collectives.several(step.accelerator)
            and cfg.grpo.dynamic_sampling != "resample"
            else None
        )
        advantages, stats = group_advantages(rewards, group, scale, batch_std=batch_std)
    weights = None
    if sampled.sampler_logprobs is not None:  # another engine sampled: measure and correct the mismatch
        with step.autocast():  # in the loss's precision (grpo.bf16), so the weights correct only the engine
            correction, weights = sampler_correction(
                step.model, rollout, sampled.sampler_logprobs, cfg.grpo.rollout
            )
        stats |= correction
    drawn = Draw(rollout, list(records), rewards, advantages, stats, weights, sampled.prefills)
    drawn.stats.update(task_reward_stats(rewards, drawn.tasks))
    drawn.stats.update(kind_stats(rollout.texts, records, group, rewards))  # a trade shows kind by kind
    return drawn


def sample(
    step: Step, records: list[dict], index: int, more_records: MoreRecordsFn, timer: PhaseTimer
) -> tuple[Draw, dict[str, float]]:
    """The groups the step trains on, and the statistics of its FIRST draw (filtering must not hide a
    reward deadlock). ``dynamic_sampling``: keep every group (``none``), drop the zero-variance ones
    (``filter``), or draw fresh prompts (``more_records(attempt)``) until the batch is full (``resample``)."""
    cfg = step.cfg.grpo

    def seed(attempt: int) -> int:
        return derive_seed(
            step.cfg.seed, ("step", index), ("process", step.accelerator.process_index), ("attempt", attempt)
        )

    first = draw(step, records, seed(0), timer)
    if cfg.dynamic_sampling == "none":
        return first, first.stats
    kept, attempt = [first.select(first.informative_groups())], 0
    while (
        cfg.dynamic_sampling == "resample"
        and sum(len(d.records) for d in kept) < len(records)
        and attempt < cfg.max_resample
    ):
        attempt += 1
        extra = draw(step, more_records(attempt), seed(attempt), timer)
        kept.append(extra.select(extra.informative_groups()))
    stats = first.stats | {
        "dynamic/draws": float(attempt + 1),
        "dynamic/kept_groups": float(sum(len(d.records) for d in kept)),
    }
    return merge_draws(first, kept, len(records), step.tokenizer.pad_token_id, stats), stats


def raise_on_nonfinite_rewards(step: Step, rewards: torch.Tensor, tasks: Sequence[str], index: int) -> None:
    """NonFiniteError on EVERY process when any process has a NaN/Inf reward (``rewards`` [N], ``tasks``
    the task of each row): a process that raised alone would leave the others in the next all-reduce."""
    bad = sorted({tasks[i] for i in torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()})
    if collectives.count_anywhere(step.accelerator, float(len(bad))):
        where = f"for task(s) {bad}" if bad else "on another process"
        raise NonFiniteError(
            f"grpo: NaN/Inf reward at step {index} {where}; "
            "check that task's reward function and rewards.weights"
        )


# --------------------------------------------------------------------------- scoring


def prepare_batch(step: Step, sampled: Draw) -> ScoredBatch:
    """Join prompt and generated ids (I3) and compute the stored old and reference log-probs, all
    under the temperature the rollout recorded (I10): the same distribution the update scores."""
    rollout, device = sampled.rollout, step.accelerator.device
    inputs = rollout_inputs(rollout, device)
    rows = {
        t: torch.tensor([i for i, x in enumerate(sampled.tasks) if x == t], dtype=torch.long, device=device)
        for t in TASKS
    }
    rows = {t: r for t, r in rows.items() if len(r)}
    # Scored part by part as the update scores (I8): where the weights are the same, the numbers are too.
    old = score_parts(step, inputs, rows, adapter=True) if step.cfg.grpo.num_iterations > 1 else None
    ref = score_parts(step, inputs, rows, adapter=False) if step.cfg.grpo.loss.beta > 0 else None
    weights = None if sampled.is_weights is None else sampled.is_weights.to(device)
    return ScoredBatch(
        inputs,
        sampled.advantages.to(device),
        old,
        ref,
        rows,
        weights,
        sampled.prefills if step.reuses_prefill else (),
        rollout.sampler,
    )


# --------------------------------------------------------------------------- the step


def grpo_step(
    step: Step, records: list[dict], index: int, more_records: MoreRecordsFn, first: bool = False
) -> StepResult:
    """Step ``index`` on this process's prompts ``records`` (``more_records(attempt)``: fresh ones for
    dynamic resampling). The result describes the global batch (all processes). Before the optimizer moves
    a weight, the sampler and the scorer must agree, and with ``first`` (the first step of a fresh run) the
    policy must be its reference (``agreement.step_checks``)."""
    started, timer = time.perf_counter(), PhaseTimer()
    with step.frozen_bf16():
        with gathered(step.model):  # FSDP: whole weights for the rollout, no collective per generated token
            sampled, sample_stats = sample(step, records, index, more_records, timer)
        raise_on_nonfinite_rewards(step, sampled.rewards, sampled.tasks, index)
        with timer("reference"):
            batch = prepare_batch(step, sampled)
        with timer("update"):
            try:
                update_stats, policy = update(step, batch, step_checks(step, batch, first))
            except (NonFiniteError, MultitaskError, StepInvariantError) as exc:  # say which step
                message = (
                    f"grpo: step {index} stopped before its update: {str(exc).removeprefix('grpo: ')}; nothing "
                    f"of step {index} was applied or saved, the checkpoints hold earlier steps only"
                )
                if isinstance(exc, StepInvariantError):
                    raise StepInvariantError(message, exc.invariant) from exc
                raise NonFiniteError(message) from exc
    result = step_result(
        step, records, sampled, sample_stats, update_stats, time.perf_counter() - started, timer
    )
    return dataclasses.replace(result, trace=StepTrace(sampled, batch, policy))


def step_result(
    step: Step,
    records: Sequence[dict],
    sampled: Draw,
    sample_stats: dict[str, float],
    update_stats: dict[str, Any],
    elapsed: float,
    timer: PhaseTimer | None = None,
) -> StepResult:
    """The step's metrics and completions over the global batch; ``records`` are the prompts of the
    first draw; ``timer`` the seconds of each phase of the step."""
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
    counts = {
        "groups": float(len(records)),
        "rows": float(len(rollout.raw_texts)),
        **{f"rows/{t}": float(g * sum(r["task"] == t for r in records)) for t in TASKS},
        **kind_counts(records, g),
    }
    metrics, raw_texts, prompt_texts = collectives.gather_step(
        step.accelerator, metrics, counts, rollout.raw_texts, per_row(user_texts, g)
    )
    return StepResult(metrics, raw_texts, prompt_texts, step.header_tokens, step.end_of_turn_tokens)
