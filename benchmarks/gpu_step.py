"""The GRPO step of ``benchmarks/gpu.py``: its training phase timed and measured apart, and its model FLOPs.

``bench_step`` runs the trainer's own ``grpo_step`` (rollout, rewards, reference pass, update) on the
benchmark's workload; ``TrainingPhase`` wraps the step's ``prepare_batch`` and ``update`` to time the
training phase with the GPU synchronised and to keep its peak memory apart from the rollout's;
``training_flops`` counts the phase's model FLOPs (see ``benchmarks/gpu.py``'s docstring).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from grpo.data.synthetic_fairness import generate_fairness
from grpo.data.synthetic_grounded import generate_grounded
from grpo.train import step as step_module
from grpo.train.policy import Policy


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset; on a CPU the process's peak resident size."""
    if device.type == "cuda":
        sync(device)
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def profiler(device: torch.device) -> torch.profiler.profile:
    """A profiler of the host's and (on CUDA) the GPU's work."""
    kinds = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch.profiler.profile(activities=kinds)


def profile_table(device: torch.device, profile: torch.profiler.profile) -> str:
    """The profiler's 30 costliest operations (by GPU time on CUDA, host time elsewhere)."""
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profile.key_averages().table(sort_by=key, row_limit=30)


def profile_path(args, architecture: str, what: str) -> Path:
    """Where ``--profile`` writes a table: beside ``--out``, named by the architecture and the phase."""
    out = Path(args.out)
    return out.with_name(f"{out.stem}.{architecture}.{what}-profile.txt")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def records(n: int, seed: int) -> list[dict]:
    """``n`` prompts of the project's own data, half of each task."""
    fair = generate_fairness(n // 2, "train", seed)
    return fair + generate_grounded(n - len(fair), "train", seed, answerable_fraction=0.5)


def timed(device: torch.device, run) -> float:
    sync(device)
    started = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - started


def lora_parameters(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def training_flops(config, rows: int, distinct: int, prompt: int, completion: int, shared: bool,
                   reused_prefill: bool, body: int, lora: int, passes: dict[str, int], full: bool) -> float:
    """Model FLOPs of the training phase (see the module docstring). ``body``: non-embedding, non-head
    parameters; ``passes``: forward passes without grad (reference, old log-probs) and policy passes."""
    prompt_tokens = distinct * prompt if shared else rows * prompt
    completion_tokens = rows * completion
    tokens = prompt_tokens + completion_tokens
    head = 2.0 * config.vocab_size * config.hidden_size * completion_tokens
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    keys = (distinct if shared else rows) * prompt * (prompt + 1) / 2 + rows * (
        completion * prompt + completion * (completion + 1) / 2)
    attention = 4.0 * config.num_hidden_layers * width * keys
    scoring = 2.0 * body * tokens + attention + head  # one forward pass without grad, adapter off
    forward = 2.0 * (body + lora) * (completion_tokens if reused_prefill else tokens) + head + attention
    backward = 2.0 * (body + lora) * tokens + 2 * attention + head + 2.0 * lora * tokens
    if full:
        backward += 2.0 * body * tokens + head
    return passes["scoring"] * scoring + passes["policy"] * (forward + backward)


class TrainingPhase:
    """Wraps the step's ``prepare_batch`` and ``update`` (reference pass, then the update): times them with
    the GPU synchronised, keeps the rollout's and the training phase's peak memory apart, and profiles the
    phase when ``profile`` is set."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.profile, self.table = device, False, ""
        self.seconds = self.rollout_peak = self.train_peak = 0.0
        self._prepare, self._update = step_module.prepare_batch, step_module.update
        self._started, self._profiler = 0.0, None

    def prepare(self, *args):
        self.rollout_peak = peak_gib(self.device)
        reset_peak(self.device)
        if self.profile:
            self._profiler = profiler(self.device)
            self._profiler.__enter__()
        self._started = time.perf_counter()
        return self._prepare(*args)

    def update(self, *args):
        out = self._update(*args)
        sync(self.device)
        self.seconds = time.perf_counter() - self._started
        self.train_peak = peak_gib(self.device)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.table = profile_table(self.device, self._profiler)
            self._profiler = None
        return out

    def __enter__(self) -> TrainingPhase:
        step_module.prepare_batch, step_module.update = self.prepare, self.update
        return self

    def __exit__(self, *exc) -> None:
        step_module.prepare_batch, step_module.update = self._prepare, self._update


def step_flops(model, cfg, step, trace, prompts: int) -> float:
    """Model FLOPs of one step's training phase, from the widths its rollout ran at (``trace``)."""
    rollout = trace.draw.rollout
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings().weight.numel()
    head = 0 if base.config.tie_word_embeddings else base.get_output_embeddings().weight.numel()
    lora = lora_parameters(model)
    body = sum(p.numel() for p in model.parameters()) - embedding - head - lora
    return training_flops(
        base.config, rows=rollout.prompt_ids.shape[0], distinct=prompts, prompt=rollout.prompt_ids.shape[1],
        completion=rollout.completion_ids.shape[1], shared=step.shares_prefix, reused_prefill=step.reuses_prefill,
        body=body, lora=lora, full=False,
        passes={"scoring": int(cfg.grpo.loss.beta > 0) + int(cfg.grpo.num_iterations > 1),
                "policy": cfg.grpo.num_iterations})


def bench_step(model, tokenizer, cfg, args, device, plan: dict) -> dict:
    """The GRPO step: a warm-up step, then ``plan['steps']`` timed on new prompts (one step only when 1),
    then, with more than one, one step on the first timed step's prompts again (every shape seen before:
    what a long run's steps cost once its prompt widths recur); with ``--profile`` one more whose training
    phase runs under the profiler. Each step's FLOPs come from its own widths."""
    from accelerate import Accelerator

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.grpo.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model.train()
    step = step_module.build_step(cfg, Policy(model, tokenizer, optimizer, scheduler, None),
                                  Accelerator(cpu=device.type == "cpu"))
    count = 1 + plan["steps"] if plan["steps"] > 1 else 1
    seeds = [10 + index for index in range(count)] + ([11] if count > 1 else [])  # 11: the first timed step's
    profile = args.profile
    runs, table, trace = [], "", None
    with TrainingPhase(device) as phase:
        for index, seed in enumerate(seeds + [10 + len(seeds)] * int(profile)):
            phase.profile = index == len(seeds)
            batch = records(args.prompts, seed=seed)
            reset_peak(device)
            sync(device)
            started = time.perf_counter()
            result = step_module.grpo_step(step, batch, index + 1, lambda attempt, b=batch: b)
            sync(device)
            if phase.profile:
                table = phase.table
                continue
            trace = result.trace
            flops = step_flops(model, cfg, step, trace, args.prompts)
            runs.append({"step_s": time.perf_counter() - started, "rollout_s": result.metrics["timing/generate"],
                         "train_s": phase.seconds, "flops": flops, "tflops_per_s": flops / phase.seconds / 1e12,
                         "rollout_peak_gib": phase.rollout_peak, "train_peak_gib": phase.train_peak,
                         "prompt_width": trace.draw.rollout.prompt_ids.shape[1], "seen_shapes": seed in seeds[:index]})
    if table:
        profile_path(args, cfg.model.architecture, "training").write_text(table)
    new = [r for r in runs[1:] if not r["seen_shapes"]] or runs
    seen = [r for r in runs if r["seen_shapes"]]
    median = sorted(new, key=lambda r: r["train_s"])[len(new) // 2]
    rollout = trace.draw.rollout
    return {
        "rows": rollout.prompt_ids.shape[0], "prompt_width": median["prompt_width"],
        "completion_width": rollout.completion_ids.shape[1], "grad_accum": cfg.grpo.grad_accum,
        "shares_prefix": step.shares_prefix, "reuses_prefill": step.reuses_prefill,
        "steps": runs, "step_s": median["step_s"], "rollout_s": median["rollout_s"],
        "train_s": median["train_s"], "flops": median["flops"],
        "tflops_per_s": median["tflops_per_s"],
        "seen_shapes": ({"train_s": seen[-1]["train_s"], "tflops_per_s": seen[-1]["tflops_per_s"]} if seen else None),
        "step_peak_gib": max(max(r["rollout_peak_gib"], r["train_peak_gib"]) for r in runs),
        "train_peak_gib": max(r["train_peak_gib"] for r in runs),
    }
