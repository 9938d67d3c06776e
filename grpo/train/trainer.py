"""Stage ``grpo``: the GRPO loop on both reward tasks.

One step: sample prompts of both tasks -> G completions each (token ids) -> rewards -> group
advantages -> per-task losses on each task's own rows -> multitask gradient combination -> clipped
optimizer step. With ``model.lora.enabled`` the policy is a LoRA adapter on the SFT weights and the
reference is the same model with the adapter disabled (I9), so no second copy of the weights exists;
without it every weight trains and the reference is a frozen copy of the SFT model. Every step is
seeded by (seed, step), which is what makes a resumed run end with the same weights as an
uninterrupted one. Which checkpoint becomes ``models/grpo`` is checkpoint selection's choice
(``selection.py``: the best on a validation split by its worst kind of item; the last step under
``grpo.selection.rule: last``).

Several processes (``accelerate launch``, torchrun): each draws its shard of the step's prompts and
the per-task gradients are summed over processes before they are combined; under an FSDP launch the
policy itself is sharded (``sharding.py``). Checkpoints hold whole tensors and resume on any number
of processes; what a different number changes is the sampling: each process seeds its rollouts by
(seed, step, process index), so the completions after resume differ from those the original number
of processes would have drawn (the prompts, a function of (seed, step), do not).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from grpo import paths
from grpo.config import Config, config_to_dict
from grpo.data.select import split_by_task, train_records
from grpo.errors import GrpoError
from grpo.files import write_json
from grpo.health.kinds import progress as kinds_progress
from grpo.health.metrics import MetricsWriter
from grpo.health.monitor import Monitor, raise_if_stop
from grpo.locks import writes
from grpo.model.device import make_accelerator
from grpo.model.loading import save_model
from grpo.provenance.gate import require_preflight
from grpo.provenance.lineage import is_stale, make_lineage, write_lineage
from grpo.seeding import derive_seed
from grpo.train import checkpoint as ckpt
from grpo.train import sharding
from grpo.train.policy import Policy
from grpo.train.rng_state import capture_rng, restore_rng
from grpo.train.selection import Selector
from grpo.train.step import StepResult, build_training, grpo_step
from grpo.train.task_mix import sample_step, shard


class TrainingError(GrpoError):
    """Training cannot go on (non-finite loss or gradient, ...); nothing half-updated was saved."""


def resume(cfg: Config, policy: Policy) -> tuple[int, list[dict]]:
    """Continue from the newest complete checkpoint written by this code, params and inputs."""
    latest = ckpt.latest_checkpoint(paths.run_dir(cfg)) if cfg.checkpoint.resume else None
    if latest is None:
        return 0, []
    reason = is_stale(latest, "grpo", cfg, paths.stage_inputs(cfg, "grpo"))
    if reason:
        print(f"grpo: not resuming from {latest}: {reason}; starting fresh")
        return 0, []
    restored = ckpt.load_checkpoint(
        latest, model=policy.model, optimizer=policy.optimizer, scheduler=policy.scheduler
    )
    restore_rng(restored.rng, {})
    print(f"grpo: resuming from {latest} (step {restored.step})")
    return restored.step, list(restored.history)


def save_final(
    cfg: Config,
    policy: Policy,
    lineage: dict,
    history: list[dict],
    digests: list[str],
    weights: dict[str, torch.Tensor] | None = None,
    chosen: dict | None = None,
) -> None:
    """The adapter (or the full weights), tokenizer and lineage to models/grpo; a summary to
    metrics/grpo.json. ``weights``: the whole weights gathered from a sharded policy; ``chosen``: the
    checkpoint selection's record, when it chose (``selection.Selector.finish``)."""
    out = paths.model_dir(cfg, "grpo")
    save_model(policy.model, policy.tokenizer, out, state_dict=weights)
    write_lineage(out, lineage)
    last = history[-1] if history else {}
    summary = {
        key: last.get(key) for key in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "kl")
    }
    summary |= {
        "steps": len(history),
        "reward_first": history[0]["reward"] if history else None,
        "process_weight_digests": digests,
    }
    # Mean seconds (and share) of each step phase over the run: the Prefect metrics artifact shows them.
    summary |= {key: sum(h[key] for h in history) / len(history) for key in last if key.startswith("timing/")}
    # The step models/grpo holds: selection's choice, or the last one (grpo.selection.rule: last).
    summary["selected_step"] = chosen["step"] if chosen else last.get("step")
    summary["selection"] = chosen
    write_json(paths.metrics_file(cfg, "grpo"), summary)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the trainable weights: equal on every process, or the processes have diverged."""
    digest = hashlib.sha256()
    for name, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        digest.update(name.encode())
        whole = sharding.full_tensor(param.detach())  # under FSDP a gather: every process calls it
        digest.update(whole.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_in_sync(policy: Policy, accelerator: Accelerator) -> list[str]:
    """Every process's weight digest; raises when they differ (a silent desync of data parallelism)."""
    digests = (
        gather_object([weights_digest(policy.model)])
        if accelerator.num_processes > 1
        else [weights_digest(policy.model)]
    )
    if len(set(digests)) > 1:
        raise TrainingError(f"grpo: the processes' weights differ after training: {digests}")
    return digests


def _shard(cfg: Config, by_task: dict, index: int, attempt: int, accelerator: Accelerator) -> list[dict]:
    """This process's prompts of step ``index`` (``attempt`` > 0: fresh prompts for dynamic resampling)."""
    seed = derive_seed(cfg.seed, ("attempt", attempt))
    grpo = cfg.grpo
    records = sample_step(by_task, grpo.prompts_per_step, grpo.fairness_fraction, seed, index, grpo.kind_share)
    return shard(records, accelerator.process_index, accelerator.num_processes)


def save_checkpoint(
    cfg: Config,
    policy: Policy,
    accelerator: Accelerator,
    index: int,
    history: list[dict],
    lineage: dict,
    keep: tuple[int, ...] = (),
) -> None:
    """The main process writes; under FSDP every process first gives its shards (a gather). ``keep``:
    earlier checkpoints pruning spares (the best one selection has seen)."""
    if not (accelerator.is_main_process or sharding.is_sharded(policy.model)):
        return
    state = ckpt.full_state(policy.model, policy.optimizer)
    if accelerator.is_main_process:
        ckpt.save_checkpoint(
            paths.run_dir(cfg),
            index,
            model=policy.model,
            optimizer=policy.optimizer,
            scheduler=policy.scheduler,
            rng=capture_rng({}),
            history=history,
            lineage=lineage,
            keep_last=cfg.checkpoint.keep_last,
            state=state,
            keep=keep,
        )


def watch(monitor: Monitor, index: int, result: StepResult, run_dir: Path | None = None) -> None:
    """Apply the monitor to step ``index``; ``result`` describes the global batch (the same on every
    process), so every process decides alike and all stop together, none left in an all-reduce.
    ``run_dir``: where the run's checkpoints are, for the stop message to name the last healthy one."""
    findings = monitor.observe(index, result.metrics)  # boundary text checks run on the first steps only
    findings += monitor.check_boundary(
        index, result.raw_texts, result.prompt_texts, result.header_tokens, result.end_of_turn_tokens
    )
    raise_if_stop(findings, None if run_dir is None else lambda: ckpt.checkpoint_steps(run_dir))


class Trained(NamedTuple):
    """What ``train`` did."""

    history: list[dict]
    """Every step's metrics, those restored from the checkpoint first."""
    restored: int
    """Steps restored from the checkpoint the run resumed from (0: a fresh run)."""
    saved: bool
    """Whether the policy was saved (all ``grpo.steps`` done); else the last step is only a checkpoint."""


def metrics_writer(cfg: Config, accelerator: Accelerator, start: int, history: list[dict]) -> MetricsWriter:
    """Where the steps' metrics go (metrics.jsonl, W&B), continuing after step ``start`` of a resumed run
    (``history``: the steps restored); only the main process writes."""
    return MetricsWriter(
        paths.run_dir(cfg),
        cfg.experiment,
        cfg.tracking,
        config_to_dict(cfg),
        is_main_process=accelerator.is_main_process,
        resume_step=start,
        restored=history,
    )


def progress_fields(metrics: dict) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    return {
        "reward": f"{metrics['reward']:.2f}",
        "entropy": f"{metrics['entropy']:.2f}",
        "step_time": f"{metrics['step_time']:.1f}s",
        "kinds": kinds_progress(metrics),
    }


def train(cfg: Config, max_steps: int | None = None, progress: bool = True) -> Trained:
    """Run (or resume) GRPO. Raises TrainingStopped on a collapse."""
    require_preflight(cfg)
    accelerator = make_accelerator()
    step = build_training(cfg, accelerator, shard=sharding.policy_sharder(cfg, accelerator))
    policy = step.policy
    lineage = make_lineage("grpo", cfg, paths.stage_inputs(cfg, "grpo"))
    start, history = resume(cfg, policy)
    step.engine.sync_weights(policy.model)  # an engine of its own (vLLM) samples from the resumed weights
    selector = Selector(cfg, step, train_records(cfg, "grpo"), paths.run_dir(cfg))
    by_task = split_by_task(selector.prompts)  # the validation records are never prompts
    monitor = Monitor(cfg.monitor, history)
    writer = metrics_writer(cfg, accelerator, start, history)
    end = min(cfg.grpo.steps, start + max_steps) if max_steps else cfg.grpo.steps
    bar = tqdm(range(start + 1, end + 1), desc="grpo", disable=not (progress and accelerator.is_main_process))
    try:
        for index in bar:
            result = grpo_step(
                step,
                _shard(cfg, by_task, index, 0, accelerator),
                index,
                lambda attempt, index=index: _shard(cfg, by_task, index, attempt, accelerator),
                first=start == 0 and index == 1,  # a fresh run: the policy must be its reference (I8, I9)
            )
            # before saving: a collapsed state never becomes a checkpoint
            watch(monitor, index, result, paths.run_dir(cfg))
            step.engine.sync_weights(policy.model)  # vLLM samples the next step from the new weights
            metrics = result.metrics | selector.scores(index)  # selection/<kind> on its steps
            history.append({"step": index, **metrics})
            writer.log(index, metrics)
            bar.set_postfix(refresh=False, **progress_fields(result.metrics))
            if index % cfg.checkpoint.every == 0 or index == end or selector.due(index):
                save_checkpoint(cfg, policy, accelerator, index, history, lineage, selector.keep(history))
            accelerator.wait_for_everyone()
    finally:
        writer.close()
    digests = check_in_sync(policy, accelerator)
    if end == cfg.grpo.steps:
        chosen = selector.finish(history, end, accelerator.is_main_process)  # the best checkpoint's weights
        weights = sharding.whole_state_dict(policy.model)  # FSDP: every process gathers its shards
        if accelerator.is_main_process:
            save_final(cfg, policy, lineage, history, digests, weights, chosen)
    return Trained(history, start, end == cfg.grpo.steps)


def with_selection(cfg: Config, select: str | None) -> Config:
    """``cfg`` with ``grpo.selection.rule`` set to ``select`` (``grpo train --select``); None keeps it. An
    override like any other: it enters the params hash of the lineage models/grpo records."""
    if select is None:
        return cfg
    selection = cfg.grpo.selection.model_copy(update={"rule": select})
    return cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"selection": selection})})


@writes(paths.run_dir, lambda cfg: paths.model_dir(cfg, "grpo"))
def run(cfg: Config, max_steps: int | None = None, select: str | None = None) -> int:
    """``grpo train [--max-steps N] [--select last]``: train (or resume), then save the policy when all
    steps ran."""
    cfg = with_selection(cfg, select)
    started = time.perf_counter()
    trained = train(cfg, max_steps=max_steps)
    last, new = (trained.history[-1]["step"] if trained.history else 0), len(trained.history) - trained.restored
    restored = f" after {trained.restored} restored from its checkpoint" if trained.restored else ""
    written = (
        f"policy in {paths.model_dir(cfg, 'grpo')}"
        if trained.saved
        else f"no policy written yet: step {last} of grpo.steps={cfg.grpo.steps} is a checkpoint in "
        f"{paths.run_dir(cfg)}, from which `grpo train` continues"
    )
    print(
        f"grpo: {new} new step{'' if new == 1 else 's'}{restored} in {time.perf_counter() - started:.1f}s; "
        f"{written}"
    )
    return 0
