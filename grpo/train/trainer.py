"""Stage ``grpo``: the GRPO loop on both reward tasks.

One step: sample prompts of both tasks -> G completions each (token ids) -> rewards -> group
advantages -> per-task losses on each task's own rows -> multitask gradient combination -> clipped
optimizer step. The policy is a LoRA adapter on the SFT weights; the reference is the same model with
the adapter disabled (I9), so no second copy of the weights exists. Every step is seeded by
(seed, step), which is what makes a resumed run end with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from grpo.checks.preflight import require_preflight
from grpo.config import Config, config_to_dict
from grpo.data.jsonl import read_records
from grpo.errors import GrpoError
from grpo.health.metrics import MetricsWriter
from grpo.health.monitor import Monitor, raise_if_stop
from grpo.model.modeling import save_model, wrap_lora
from grpo.model.rollout import stop_ids
from grpo.provenance.lineage import is_stale, make_lineage, write_lineage
from grpo.train import checkpoint as ckpt
from grpo.train.sft import load_sft, sft_dir
from grpo.train.step import StepContext, grpo_step
from grpo.train.task_mix import sample_step, split_by_task


class TrainingError(GrpoError):
    """Training cannot go on (non-finite loss or gradient, ...); nothing half-updated was saved."""


@dataclass
class Policy:
    """What the loop mutates: the LoRA-wrapped model and its optimizer state."""

    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def run_dir(cfg: Config) -> Path:
    return Path(cfg.paths.runs_dir) / cfg.experiment


def grpo_dir(cfg: Config) -> Path:
    return Path(cfg.paths.models_dir) / "grpo"


def grpo_inputs(cfg: Config) -> dict[str, Path]:
    return {"sft": sft_dir(cfg), "train": Path(cfg.paths.data_dir) / "train.jsonl"}


def build_policy(cfg: Config, device: torch.device) -> Policy:
    """LoRA on the SFT weights; every process draws the same adapter init from ``cfg.seed``."""
    model, tokenizer = load_sft(cfg)
    torch.manual_seed(cfg.seed)
    model = wrap_lora(model, cfg.model.lora).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.grpo.lr, weight_decay=0.0)
    warmup = cfg.grpo.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return Policy(model, tokenizer, optimizer, scheduler)


def resume(cfg: Config, policy: Policy) -> tuple[int, list[dict]]:
    """Continue from the newest complete checkpoint written by this code, params and inputs."""
    latest = ckpt.latest_checkpoint(run_dir(cfg)) if cfg.checkpoint.resume else None
    if latest is None:
        return 0, []
    reason = is_stale(latest, "grpo", cfg, grpo_inputs(cfg))
    if reason:
        print(f"grpo: not resuming from {latest}: {reason}; starting fresh")
        return 0, []
    restored = ckpt.load_checkpoint(latest, model=policy.model, optimizer=policy.optimizer,
                                    scheduler=policy.scheduler)
    ckpt.restore_rng(restored.rng, {})
    print(f"grpo: resuming from {latest} (step {restored.step})")
    return restored.step, list(restored.history)


def save_final(cfg: Config, policy: Policy, lineage: dict, history: list[dict], digests: list[str]) -> None:
    """The adapter, tokenizer and lineage to models/grpo; a summary to metrics/grpo.json."""
    out = grpo_dir(cfg)
    save_model(policy.model, policy.tokenizer, out)
    write_lineage(out, lineage)
    last = history[-1] if history else {}
    summary = {key: last.get(key) for key in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "kl")}
    summary |= {"steps": len(history), "reward_first": history[0]["reward"] if history else None,
                "process_weight_digests": digests}
    # Mean seconds (and share) of each step phase over the run: the Prefect metrics artifact shows them.
    summary |= {key: sum(h[key] for h in history) / len(history) for key in last if key.startswith("timing/")}
    metrics = Path(cfg.paths.metrics_dir)
    metrics.mkdir(parents=True, exist_ok=True)
    (metrics / "grpo.json").write_text(json.dumps(summary, indent=2) + "\n")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the trainable weights: equal on every process, or the processes have diverged."""
    digest = hashlib.sha256()
    for name, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_in_sync(policy: Policy, accelerator: Accelerator) -> list[str]:
    """Every process's weight digest; raises when they differ (a silent desync of data parallelism)."""
    digests = gather_object([weights_digest(policy.model)]) if accelerator.num_processes > 1 else [
        weights_digest(policy.model)]
    if len(set(digests)) > 1:
        raise TrainingError(f"grpo: the processes' weights differ after training: {digests}")
    return digests


def _shard(cfg: Config, by_task: dict, step: int, attempt: int, accelerator: Accelerator) -> list[dict]:
    """This process's prompts of ``step`` (``attempt`` > 0: fresh prompts for dynamic resampling)."""
    seed = cfg.seed + attempt * 7_919_993
    records = sample_step(by_task, cfg.grpo.prompts_per_step, cfg.grpo.fairness_fraction, seed, step)
    return records[accelerator.process_index :: accelerator.num_processes]


def _context(cfg: Config, policy: Policy, accelerator: Accelerator) -> StepContext:
    eos_ids = stop_ids(policy.model, policy.tokenizer, cfg.model.extra_stop_tokens)
    return StepContext(cfg=cfg, model=policy.model, tokenizer=policy.tokenizer, optimizer=policy.optimizer,
                       scheduler=policy.scheduler, eos_ids=eos_ids, accelerator=accelerator)


def train(cfg: Config, max_steps: int | None = None, progress: bool = True) -> list[dict]:
    """Run (or resume) GRPO; returns the metric history. Raises TrainingStopped on a collapse."""
    require_preflight(cfg)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              mixed_precision="bf16" if cfg.grpo.bf16 and torch.cuda.is_available() else "no")
    policy = build_policy(cfg, accelerator.device)
    lineage = make_lineage("grpo", cfg, grpo_inputs(cfg))
    start, history = resume(cfg, policy)
    by_task = split_by_task(read_records(Path(cfg.paths.data_dir) / "train.jsonl"))
    context = _context(cfg, policy, accelerator)
    monitor = Monitor(cfg.monitor)
    writer = MetricsWriter(run_dir(cfg), cfg.experiment, cfg.tracking, config_to_dict(cfg),
                           is_main_process=accelerator.is_main_process, resume_step=start)
    end = min(cfg.grpo.steps, start + max_steps) if max_steps else cfg.grpo.steps
    bar = tqdm(range(start + 1, end + 1), desc="grpo", disable=not (progress and accelerator.is_main_process))
    try:
        for step in bar:
            result = grpo_step(context, _shard(cfg, by_task, step, 0, accelerator), step,
                               lambda attempt, step=step: _shard(cfg, by_task, step, attempt, accelerator))
            findings = monitor.observe(step, result.metrics)  # boundary text checks run on the first steps only
            findings += monitor.check_boundary(step, result.raw_texts, result.prompt_texts,
                                               result.header_tokens, result.end_of_turn_tokens)
            raise_if_stop(findings)  # before saving: a collapsed state never becomes a checkpoint
            history.append({"step": step, **result.metrics})
            writer.log(step, result.metrics)
            bar.set_postfix(reward=f"{result.metrics['reward']:.2f}", entropy=f"{result.metrics['entropy']:.2f}",
                            step_time=f"{result.metrics['step_time']:.1f}s")
            if accelerator.is_main_process and (step % cfg.checkpoint.every == 0 or step == end):
                ckpt.save_checkpoint(run_dir(cfg), step, model=policy.model, optimizer=policy.optimizer,
                                     scheduler=policy.scheduler, rng=ckpt.capture_rng({}), history=history,
                                     lineage=lineage, keep_last=cfg.checkpoint.keep_last)
            accelerator.wait_for_everyone()
    finally:
        writer.close()
    digests = check_in_sync(policy, accelerator)
    if accelerator.is_main_process and end == cfg.grpo.steps:
        save_final(cfg, policy, lineage, history, digests)
    return history


def run(cfg: Config, args=None) -> int:
    started = time.perf_counter()
    history = train(cfg, max_steps=getattr(args, "max_steps", None))
    print(f"grpo: {len(history)} steps in {time.perf_counter() - started:.1f}s; adapter in {grpo_dir(cfg)}")
    return 0
