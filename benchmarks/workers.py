"""One benchmark variant in its own process: ``python -m benchmarks.workers VARIANT PROJECT STEPS WARMUP``.

Prints one JSON line: the seconds of every timed optimizer step, the completion tokens of each, the
median seconds of each step phase (project only) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

WORKLOAD = {
    "prompts": 8,
    "group_size": 4,
    "rows": 32,
    "max_new_tokens": 32,
    "beta": 0.04,
    "loss_type": "grpo",
    "lora_r": 8,
    "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "dtype": "float32 weights; the project's compute as params.yaml's grpo.bf16 says, *-bf16 with bf16 autocast",
}
PLAIN = {"grpo.shared_prefix=false", "grpo.multitask.low_memory=false", "grpo.multitask.task_stats=true"}
VARIANTS = {
    "project-sum": {"grpo.multitask.mode=sum"},
    "project-cagrad": {"grpo.multitask.mode=cagrad"},
    "project-sum-bf16": {"grpo.multitask.mode=sum", "grpo.bf16=true"},
    "project-sum-off": {"grpo.multitask.mode=sum", "model.fast_paths=off"},  # the libraries' paths
    "plain-sum": {"grpo.multitask.mode=sum"} | PLAIN,
    "plain-cagrad": {"grpo.multitask.mode=cagrad"} | PLAIN,
    "trl-fp32": set(),
    "trl-bf16": set(),
    "trl-fp32-retain": set(),  # with the allocator setting the project's CPU stages use (retain_freed_memory)
    "trl-bf16-retain": set(),
}


def workload_overrides(full_length: bool) -> list[str]:
    sets = [
        f"grpo.prompts_per_step={WORKLOAD['prompts']}",
        f"grpo.group_size={WORKLOAD['group_size']}",
        f"grpo.sampling.max_new_tokens={WORKLOAD['max_new_tokens']}",
        f"grpo.loss.beta={WORKLOAD['beta']}",
        f"grpo.loss.loss_type={WORKLOAD['loss_type']}",
        f"model.lora.r={WORKLOAD['lora_r']}",
        "grpo.sampling.temperature=1.0",
        "grpo.sampling.top_p=1.0",
        "grpo.sampling.top_k=0",
        "grpo.num_iterations=1",
        "grpo.grad_accum=1",
    ]
    return sets + ([f"grpo.sampling.min_new_tokens={WORKLOAD['max_new_tokens']}"] if full_length else [])


def step_records(cfg, steps: int) -> list[list[dict]]:
    """The prompts of steps 1..steps, as the trainer samples them (both tasks every step)."""
    from grpo.data.jsonl import read_records
    from grpo.data.select import split_by_task
    from grpo.train.task_mix import sample_step

    by_task = split_by_task(read_records(Path(cfg.paths.data_dir) / "train.jsonl"))
    return [
        sample_step(by_task, cfg.grpo.prompts_per_step, cfg.grpo.fairness_fraction, cfg.seed, index)
        for index in range(1, steps + 1)
    ]


def project_step(project: Path, variant: str, full_length: bool):
    """The project's GRPO step (``Step``) for ``variant`` of the workload -> ``(cfg, step)``: the project's SFT
    model under a fresh LoRA adapter, as the trainer builds it."""
    from accelerate import Accelerator

    from grpo.config import load_config
    from grpo.model.device import retain_freed_memory
    from grpo.model.loading import load_model, load_tokenizer
    from grpo.model.lora import wrap_lora
    from grpo.train.policy import Policy
    from grpo.train.step import build_step

    retain_freed_memory()  # as the trainer's make_accelerator on a CPU-only machine
    cfg = load_config(project / "params.yaml", [*workload_overrides(full_length), *sorted(VARIANTS[variant])])
    cfg = cfg.model_copy(
        update={
            "paths": cfg.paths.model_copy(
                update={k: str(project / v) for k, v in cfg.paths.model_dump().items()}
            )
        }
    )
    sft = Path(cfg.paths.models_dir) / "sft"
    tokenizer = load_tokenizer(sft, cfg.model)
    torch.manual_seed(cfg.seed)
    model = wrap_lora(load_model(sft, cfg.model), cfg.model.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.grpo.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return cfg, build_step(cfg, Policy(model, tokenizer, optimizer, scheduler, None), Accelerator(cpu=True))


def project_worker(
    project: Path, variant: str, steps: int, warmup: int, full_length: bool, profile: bool = False
) -> dict:
    from grpo.train.step import grpo_step

    cfg, step = project_step(project, variant, full_length)
    times, tokens, phases, decode, table = [], [], [], [], []
    # With ``profile``, one more step after the timed ones runs under the profiler (its overhead untimed).
    for index, records in enumerate(step_records(cfg, warmup + steps + int(profile)), start=1):
        started = time.perf_counter()
        with _profiled(index > warmup + steps, table):
            metrics = grpo_step(step, records, index, lambda attempt, r=records: r).metrics
        if warmup < index <= warmup + steps:
            times.append(time.perf_counter() - started)
            tokens.append(metrics["completions/mean_length"] * WORKLOAD["rows"])
            phases.append(
                {
                    k.split("/", 1)[1]: v
                    for k, v in metrics.items()
                    if k.startswith("timing/") and not k.endswith("_share")
                }
            )
            # One decode step per token of the longest completion, every row at once (prefill included).
            decode.append(1000 * metrics["timing/generate"] / max(metrics["completions/max_length"], 1))
    return {
        "step_s": times,
        "completion_tokens": tokens,
        "decode_ms_per_step": decode,
        "profile": "".join(table),
        "phases": {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {},
    }


@contextlib.contextmanager
def _profiled(on: bool, sink: list[str]):
    """A torch profiler around the block when ``on``; its table of the costliest operators goes to ``sink``."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    sink.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


class _StepClock:
    """A TrainerCallback (built lazily: trl is optional) timing each optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.lengths: list[float] = []
        self._started = 0.0

    def on_step_begin(self, *args, **kwargs) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, *args, **kwargs) -> None:
        self.times.append(time.perf_counter() - self._started)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "completions/mean_length" in logs:
            self.lengths.append(float(logs["completions/mean_length"]))


def trl_worker(project: Path, variant: str, steps: int, warmup: int, full_length: bool) -> dict:
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.config import load_config
    from grpo.data.prompts import example_messages
    from grpo.model.device import retain_freed_memory
    from grpo.rewards import weighted_reward

    if variant.endswith("-retain"):
        retain_freed_memory()
    cfg = load_config(project / "params.yaml", workload_overrides(full_length))
    cfg = cfg.model_copy(
        update={
            "paths": cfg.paths.model_copy(
                update={k: str(project / v) for k, v in cfg.paths.model_dump().items()}
            )
        }
    )
    records = [r for step in step_records(cfg, warmup + steps) for r in step]
    dataset = Dataset.from_list([{"prompt": example_messages(r), "record": json.dumps(r)} for r in records])

    def reward(completions, record, **kwargs) -> list[float]:
        return [
            weighted_reward(json.loads(rec)["task"], c[0]["content"], json.loads(rec), cfg.rewards)
            for c, rec in zip(completions, record, strict=True)
        ]

    clock = type("StepClock", (_StepClock, TrainerCallback), {})()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=WORKLOAD["rows"],
            num_generations=WORKLOAD["group_size"],
            max_completion_length=WORKLOAD["max_new_tokens"],
            max_prompt_length=None,
            beta=WORKLOAD["beta"],
            loss_type=WORKLOAD["loss_type"],
            learning_rate=cfg.grpo.lr,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            max_steps=warmup + steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=variant.startswith("trl-bf16"),
            shuffle_dataset=False,
            disable_tqdm=True,
            seed=cfg.seed,
            generation_kwargs={"min_new_tokens": WORKLOAD["max_new_tokens"]} if full_length else None,
        )
        lora = LoraConfig(
            r=WORKLOAD["lora_r"],
            lora_alpha=cfg.model.lora.alpha,
            lora_dropout=0.0,
            target_modules=WORKLOAD["lora_targets"],
            task_type="CAUSAL_LM",
        )
        trainer = GRPOTrainer(
            model=str(Path(cfg.paths.models_dir) / "sft"),
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            peft_config=lora,
            callbacks=[clock],
        )
        trainer.train()
    lengths = clock.lengths[warmup:]
    return {
        "step_s": clock.times[warmup:],
        "completion_tokens": [n * WORKLOAD["rows"] for n in lengths],
        "phases": {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("project", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("warmup", type=int)
    parser.add_argument("--full-length", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile one more step after the timed ones")
    args = parser.parse_args(argv)
    if args.variant.startswith("trl-"):
        out = trl_worker(args.project.resolve(), args.variant, args.steps, args.warmup, args.full_length)
    else:
        out = project_worker(
            args.project.resolve(), args.variant, args.steps, args.warmup, args.full_length, args.profile
        )
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
