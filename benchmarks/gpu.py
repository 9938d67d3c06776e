"""GPU benchmark: rollouts under CUDA graphs against ``generate``, the GRPO step's MFU and peak memory.

Every figure of docs/scaling.md's GPU table in one run, on random weights in published architectures with
their real tokenizers (``model.architecture`` presets), the LoRA adapter of configs/gpu-qwen2.5-1.5b.yaml
(r 16 on q/k/v/o) over fp32 weights, bf16 autocast:

- **rollouts**: 8 prompts x 8 completions (64 rows) x 256 tokens (min = max new tokens, so every variant
  makes the same tokens' worth of work): Hugging Face ``generate`` (the library's own loop and dynamic
  cache; the faster of fp32-held and bf16-held frozen weights counts), the project's decode loop with its
  CUDA graph steps (``grpo/model/fast/graph_step.py``) and without them, and vLLM where it is installed;
- **the GRPO step** (``grpo.train.step.grpo_step``: rollout, rewards, reference pass, update) on the same
  workload: seconds per phase, peak memory of the step and of its training phase (reference + update), and
  the training phase's MFU = model FLOPs / seconds / the GPU's dense bf16 peak. Model FLOPs
  (``training_flops``): 2 x body parameters per token a pass runs through the body (each prompt once per
  group where the step shares it), 2 x vocabulary x hidden per scored position, 4 x layers x query width per
  attended key (causal), LoRA's products; a backward is the forward again for the inputs' gradients (twice
  for attention) plus the trainable weights' gradients. The split-bf16 head product counts once. The
  step's figures are the median of the timed steps, each on new prompts (new prompt widths: every shape
  new to the GPU's libraries); "shapes seen" is one more step on the first timed step's prompts, what a long
  run's steps cost once its prompt widths recur.

    python benchmarks/gpu.py                       # CUDA: 0.5B, 3B and 8B (the 8B: the step only)
    python benchmarks/gpu.py --cudnn-attention     # the same with cuDNN's attention allowed (the library's choice)
    python benchmarks/gpu.py --smoke               # CPU: shrunk presets, a few tokens (what the test runs)

The JSON goes to ``--out`` and the Markdown table beside it (``.md``), and is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_step import (  # noqa: E402
    bench_step,
    profile_path,
    profile_table,
    profiler,
    records,
    sync,
    timed,
)
from grpo.config import config_from_dict  # noqa: E402
from grpo.core.batching import left_pad  # noqa: E402
from grpo.data.prompts import render_records  # noqa: E402
from grpo.model import kernels  # noqa: E402
from grpo.model.architectures import build_architecture  # noqa: E402
from grpo.model.fast import FastPaths, graph_step  # noqa: E402
from grpo.model.lora import wrap_lora  # noqa: E402
from grpo.model.precision import autocast_enabled, bf16_autocast, frozen_linears_in_bf16  # noqa: E402
from grpo.model.rollout import sample_rollout, stop_ids  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets.
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0,
                    "L40S": 362.1, "A10G": 125.0, "L4": 121.0}
# What runs for each architecture: the rollout comparison, the step's micro-batches, timed steps.
PLAN = {
    "qwen2.5-0.5b": {"rollouts": True, "grad_accum": 1, "steps": 2},
    "llama-3.2-3b": {"rollouts": True, "grad_accum": 2, "steps": 2},
    "llama-3.1-8b": {"rollouts": False, "grad_accum": 4, "steps": 1},
}
TARGETS = {  # docs/scaling.md's targets: (architecture, figure) -> (bound, "max" or "min")
    ("llama-3.2-3b", "train_peak_gib"): (40.0, "max"),
    ("llama-3.2-3b", "mfu"): (0.40, "min"),
    ("qwen2.5-0.5b", "mfu"): (0.25, "min"),
    ("qwen2.5-0.5b", "graph_vs_generate"): (5.0, "min"),
    ("llama-3.2-3b", "graph_vs_generate"): (5.0, "min"),
    ("llama-3.1-8b", "step_peak_gib"): (80.0, "max"),
}
SMOKE_SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: shrunk presets, a few tokens")
    parser.add_argument("--architectures", nargs="+", default=None, help=f"default: {' '.join(PLAN)}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's bf16 peak")
    parser.add_argument("--tokenizers-dir", default=str(ROOT / "tests" / "fixtures" / "tokenizers"),
                        help="folder of the presets' tokenizer folders")
    parser.add_argument("--out", default=str(ROOT / "reports" / "gpu_benchmark.json"))
    parser.add_argument("--all-rollouts", action="store_true",
                        help="also generate over fp32-held frozen weights and the decode loop without graphs")
    parser.add_argument("--cudnn-attention", action="store_true",
                        help="let attention run on cuDNN too, the library's default (the project leaves it out)")
    parser.add_argument("--profile", action="store_true",
                        help="profile each architecture's decode (32 tokens, as the step runs it) and one more "
                             "step's training phase (<out>.<architecture>.decode|training-profile.txt)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.architectures = args.architectures or ["qwen2.5-0.5b"]
        args.prompts, args.group, args.tokens = 2, 2, 4
    args.architectures = args.architectures or list(PLAN)
    return args


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in BF16_PEAK_TFLOPS.items() if key in name), None)


def config(name: str, args, plan: dict):
    """The step's params: the GPU profile's LoRA and precision on ``name``, the benchmark's workload."""
    overrides = SMOKE_SHRINK | ({"head_dim": 16} if name.startswith("llama") else {}) if args.smoke else {}
    return config_from_dict({
        "model": {"architecture": name, "architecture_overrides": overrides,
                  "tokenizers_dir": args.tokenizers_dir, "lora": LORA},
        "grpo": {"prompts_per_step": args.prompts, "group_size": args.group, "bf16": True,
                 "grad_accum": plan["grad_accum"],
                 "sampling": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens}},
        "tracking": {"wandb": "disabled"},
    })


@contextlib.contextmanager
def graphs(on: bool):
    """The decode loop with its CUDA graph steps (``on``) or without; the graph steps built are collected."""
    built: list = []
    build = graph_step.GraphStep.build

    def recorded(*a):
        built.append(build(*a) if on else None)
        return built[-1]

    graph_step.GraphStep.build = staticmethod(recorded)
    try:
        yield built
    finally:
        graph_step.GraphStep.build = staticmethod(build)


def bench_rollouts(model, tokenizer, cfg, args, device) -> dict:
    """Tokens/s of 64 rows x 256 tokens: ``generate``, the decode loop without and with CUDA graphs."""
    sampling = cfg.grpo.sampling
    eos = stop_ids(model, tokenizer)
    prompts = render_records(tokenizer, records(args.prompts, seed=1), cfg.model.chat_template_kwargs)
    batch = left_pad([p for p in prompts for _ in range(args.group)], tokenizer.pad_token_id)
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    tokens = ids.shape[0] * args.tokens
    model.eval()

    def generate(new_tokens: int) -> None:
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

    def decode(new_tokens: int) -> None:
        short = sampling.model_copy(update={"max_new_tokens": new_tokens, "min_new_tokens": new_tokens})
        sample_rollout(model, tokenizer, prompts, args.group, short, eos, seed=2, fast=FastPaths.resolve("auto"))

    out: dict = {"rows": ids.shape[0], "tokens": tokens}
    variants = {
        "generate": (generate, False, None),
        "generate, frozen weights bf16": (generate, True, None),
        "decode loop": (decode, True, False),
        "decode loop, CUDA graph": (decode, True, True),
    }
    if not args.all_rollouts:  # generate at its best and the loop as the step runs it
        variants = {k: v for k, v in variants.items() if k in ("generate, frozen weights bf16", "decode loop, CUDA graph")}
    for name, (run, frozen, graphed) in variants.items():
        # The frozen weights in bf16 only under autocast (a CPU without native bf16 runs fp32, as the step does).
        held = frozen and autocast_enabled(device, True)
        with bf16_autocast(device, True), frozen_linears_in_bf16([model], held), graphs(bool(graphed)) as built:
            run(4)  # warm-up: kernels, allocator, the graph machinery
            seconds = timed(device, lambda run=run: run(args.tokens))
        entry = {"seconds": seconds, "tokens_per_s": tokens / seconds}
        if graphed is not None:
            steps = [s for s in built if s is not None]
            entry["graph"] = {"built": len(steps), "failed": [s.failed for s in steps if s.failed],
                              "static_gap": [s.gap for s in steps]}
        out[name] = entry
    if args.profile:
        with bf16_autocast(device, True), frozen_linears_in_bf16([model], autocast_enabled(device, True)), graphs(True), \
                profiler(device) as profile:
            decode(min(32, args.tokens))
            sync(device)
        profile_path(args, cfg.model.architecture, "decode").write_text(profile_table(device, profile))
    out["vllm"] = "vLLM is not installed: untested" if importlib.util.find_spec("vllm") is None else "not run"
    best_generate = max(out[k]["tokens_per_s"] for k in ("generate", "generate, frozen weights bf16") if k in out)
    out["graph_vs_generate"] = out["decode loop, CUDA graph"]["tokens_per_s"] / best_generate
    return out


def bench_architecture(name: str, args, device, peak: float | None) -> dict:
    plan = PLAN.get(name, {"rollouts": True, "grad_accum": 1, "steps": 2})
    if args.smoke:
        plan = plan | {"steps": min(plan["steps"], 2)}
    cfg = config(name, args, plan)
    started = time.perf_counter()
    model, tokenizer = build_architecture(cfg.model, seed=0, device=device)
    torch.manual_seed(cfg.seed)
    model = wrap_lora(model, cfg.model.lora)
    result = {"architecture": name, "parameters": sum(p.numel() for p in model.parameters()),
              "build_s": time.perf_counter() - started}
    parts = {"rollouts": bench_rollouts, "step": bench_step} if plan["rollouts"] else {"step": bench_step}
    for part, run in parts.items():
        extra = (plan,) if part == "step" else ()
        try:
            result[part] = run(model, tokenizer, cfg, args, device, *extra)
        except Exception as error:  # a part that fails is reported, the others still run
            result[part] = {"error": f"{type(error).__name__}: {error}"}
        print(f"gpu benchmark: {name} {part}: {json.dumps(result[part], default=str)[:600]}", flush=True)
    step = result.get("step", {})
    if "tflops_per_s" in step:
        step["mfu"] = step["tflops_per_s"] / peak if peak else None
        if step.get("seen_shapes"):
            step["seen_shapes"]["mfu"] = step["seen_shapes"]["tflops_per_s"] / peak if peak else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def figure(result: dict, key: str):
    step, rollouts = result.get("step", {}), result.get("rollouts", {})
    return {"train_peak_gib": step.get("train_peak_gib"), "step_peak_gib": step.get("step_peak_gib"),
            "mfu": step.get("mfu"), "graph_vs_generate": rollouts.get("graph_vs_generate")}[key]


def targets(results: list[dict]) -> list[dict]:
    out = []
    for (name, key), (bound, kind) in TARGETS.items():
        found = next((r for r in results if r["architecture"] == name), None)
        value = figure(found, key) if found else None
        held = None if value is None else (value <= bound if kind == "max" else value >= bound)
        out.append({"architecture": name, "figure": key, "value": value, "bound": bound, "kind": kind,
                    "held": held})
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def markdown(report: dict) -> str:
    lines = [f"GPU: {report['gpu']}; bf16 peak {report['bf16_peak_tflops'] or 'unknown'} TFLOP/s; "
             f"{report['prompts']} prompts x {report['group']} completions x {report['tokens']} tokens; "
             f"attention: {report['attention']}",
             "",
             "| architecture | generate tok/s | loop tok/s | graph tok/s | graph / generate "
             "| step s (rollout) | train s | MFU | train s, MFU (shapes seen) | peak GiB (train / step) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        ro, st = r.get("rollouts", {}), r.get("step", {})
        best = max((ro.get(k, {}).get("tokens_per_s") or 0 for k in ("generate", "generate, frozen weights bf16")),
                   default=0) or None
        seen = st.get("seen_shapes") or {}
        lines.append(
            f"| {r['architecture']} | {_num(best, '.0f')} | {_num(ro.get('decode loop', {}).get('tokens_per_s'), '.0f')} "
            f"| {_num(ro.get('decode loop, CUDA graph', {}).get('tokens_per_s'), '.0f')} "
            f"| {_num(ro.get('graph_vs_generate'), '.1f')}x "
            f"| {_num(st.get('step_s'), '.2f')} ({_num(st.get('rollout_s'), '.2f')}) "
            f"| {_num(st.get('train_s'), '.2f')} | {_percent(st.get('mfu'))} "
            f"| {_num(seen.get('train_s'), '.2f')}, {_percent(seen.get('mfu'))} "
            f"| {_num(st.get('train_peak_gib'), '.1f')} / {_num(st.get('step_peak_gib'), '.1f')} |")
    lines += ["", "| target | value | bound | held |", "| --- | ---: | ---: | --- |"]
    for t in report["targets"]:
        lines.append(f"| {t['architecture']} {t['figure']} | {_num(t['value'], '.3g')} "
                     f"| {'<=' if t['kind'] == 'max' else '>='} {t['bound']} | {t['held']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device found; the full GPU benchmark needs one. "
              "Run it on a GPU machine, or use --smoke for the CPU smoke run.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = peak_tflops(device, args.peak_tflops)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the profiles' tables are written there first
    if args.cudnn_attention:
        kernels.CUDA_BACKENDS = None
    results = [bench_architecture(name, args, device, peak) for name in args.architectures]
    report = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke run)",
        "torch": torch.__version__, "bf16_peak_tflops": peak, "smoke": args.smoke,
        "prompts": args.prompts, "group": args.group, "tokens": args.tokens,
        "attention": "cuDNN allowed (the library's choice)" if args.cudnn_attention else "cuDNN left out",
        "results": results, "targets": targets(results),
    }
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"written to {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
