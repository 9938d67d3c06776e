"""GPU benchmark: rollout tokens/s (HF ``generate`` vs vLLM), training-phase MFU and peak memory.

For each real architecture (random weights, real tokenizer: ``model.architecture`` presets):
- generation: ``prompts`` x ``group`` completions of exactly ``tokens`` tokens (min = max new tokens,
  so every engine produces the same amount), through the project's rollout engines;
- training phase: forward + backward + AdamW step of full weights in the trainer's precision (fp32
  master weights, bf16 autocast), scoring completions with ``score_completions`` as the GRPO step does;
  MFU = model FLOPs of forward + backward / time / the GPU's dense bf16 peak. Model FLOPs per token:
  6 x (non-embedding parameters) for every token, 6 x vocab x hidden for the scored positions (the
  LM head runs on those only, ``logits_to_keep``) and 12 x layers x hidden x sequence length for
  attention (PaLM, arXiv 2204.02311, appendix B);
- peak memory: ``torch.cuda.max_memory_allocated`` of each phase.

    python benchmarks/gpu.py                       # full: CUDA only, 0.5B and 3B, 8 x 8 x 256
    python benchmarks/gpu.py --smoke               # CPU: a shrunk preset, one step (what the test runs)

The JSON goes to ``--out``; a Markdown table is printed for the README.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import torch

from grpo.config import ModelConfig, RolloutConfig, SamplingConfig
from grpo.core.batching import join_prompt_completion
from grpo.core.logprobs import score_completions
from grpo.data.prompts import example_messages
from grpo.model.architectures import build_architecture
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.engines import make_engine
from grpo.model.fast import FastPaths
from grpo.model.precision import apply_memory_settings, bf16_autocast

ROOT = Path(__file__).resolve().parents[1]

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets.
BF16_PEAK_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 125.0,
    "L4": 121.0,
}
SMOKE_SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
RECORD = {
    "task": "hallucination",
    "context": "The river town of Elbrook was founded by Mara Venn in 1821 and is known for its glass works.",
    "question": "Who founded Elbrook?",
    "answer": "Mara Venn",
    "answerable": True,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU smoke run: shrunk preset, tiny sizes, one step"
    )
    parser.add_argument("--architectures", nargs="+", default=None, help="presets (default 0.5B and 3B)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--train-steps", type=int, default=3, help="timed training steps after one warm-up")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's bf16 peak")
    parser.add_argument("--tokenizers-dir", default=str(ROOT.parent / "shared" / "tokenizers"))
    parser.add_argument("--out", default=str(ROOT / "reports" / "gpu_benchmark.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.architectures = args.architectures or ["qwen2.5-0.5b"]
        args.prompts, args.group, args.tokens, args.train_steps = 2, 2, 4, 1
        args.engines = [e for e in args.engines if e == "hf"]
    args.architectures = args.architectures or ["qwen2.5-0.5b", "llama-3.2-3b"]
    return args


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in BF16_PEAK_TFLOPS.items() if key in name), None)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory of the phase; on CPU the process's peak resident size."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def training_flops(model, n_sequences: int, seq_len: int, scored: int) -> float:
    """Model FLOPs of forward + backward for ``n_sequences`` of ``seq_len`` tokens, LM head on ``scored``."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embedding  # tied LM head: counted apart below
    if not config.tie_word_embeddings:
        body -= model.get_output_embeddings().weight.numel()
    head = config.vocab_size * config.hidden_size
    tokens = n_sequences * seq_len
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len * tokens
    return 6.0 * body * tokens + 6.0 * head * n_sequences * scored + attention


def bench_generation(engine_name: str, model, tokenizer, prompts, args, device) -> dict:
    """Tokens/s of ``prompts`` x ``group`` completions of exactly ``tokens`` tokens. HF ``generate``
    runs under bf16 autocast, so both engines compute in bf16 (the trainer's own HF rollout does not)."""
    sampling = SamplingConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    eos = end_of_turn_ids(tokenizer)
    cfg = RolloutConfig(engine=engine_name, sleep=False, gpu_memory_utilization=0.4)
    engine = make_engine(cfg, model, tokenizer, max_model_len=1024, seed=0, fast=FastPaths.resolve("auto"))
    warm = SamplingConfig(max_new_tokens=4, min_new_tokens=4)
    with bf16_autocast(device, bf16=engine_name == "hf"):
        engine.generate(prompts[:1], 2, warm, eos, seed=0)
        reset_memory(device)
        started = time.perf_counter()
        out = engine.generate(prompts, args.group, sampling, eos, seed=1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    tokens = int(out.rollout.lengths.sum())
    result = {
        "engine": engine_name,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "peak_memory_gib": peak_memory_gib(device),
    }
    del engine
    return result


def bench_training(model, rollout, args, device) -> dict:
    """Forward + backward + AdamW over the rollout's sequences in micro-batches, as the GRPO step scores."""
    joined = join_prompt_completion(
        rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask
    )
    ids, mask = joined.input_ids.to(device), joined.attention_mask.to(device)
    width = rollout.completion_ids.shape[1]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, ids.shape[0], args.micro_batch):
            part = slice(start, start + args.micro_batch)
            with bf16_autocast(device, bf16=True):
                scored = score_completions(model, ids[part], mask[part], width, temperature=1.0)
            (-scored.logprobs.float().mean() * ids[part].shape[0] / ids.shape[0]).backward()
        optimizer.step()

    one_step()  # warm-up: kernels, allocator, optimizer state
    reset_memory(device)
    started = time.perf_counter()
    for _ in range(args.train_steps):
        one_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / args.train_steps
    flops = training_flops(model, ids.shape[0], ids.shape[1], width)
    return {
        "sequences": ids.shape[0],
        "seq_len": ids.shape[1],
        "step_s": seconds,
        "flops_per_step": flops,
        "tflops_per_s": flops / seconds / 1e12,
        "peak_memory_gib": peak_memory_gib(device),
    }


def bench_architecture(name: str, args, device) -> dict:
    overrides = SMOKE_SHRINK if args.smoke else {}
    if args.smoke and name.startswith("llama"):
        overrides = SMOKE_SHRINK | {"head_dim": 16}
    cfg = ModelConfig(
        architecture=name,
        architecture_overrides=overrides,
        tokenizers_dir=args.tokenizers_dir,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    model, tokenizer = build_architecture(cfg, seed=0)
    apply_memory_settings(model, cfg)
    model.to(device)
    prompts = [render_prompt(tokenizer, example_messages(RECORD)) for _ in range(args.prompts)]
    result = {
        "architecture": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "generation": [],
        "training": None,
    }
    for engine in args.engines:
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            result["generation"].append({"engine": "vllm", "skipped": "vLLM is not installed"})
            continue
        result["generation"].append(bench_generation(engine, model, tokenizer, prompts, args, device))
    sampling = SamplingConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    rollout = (
        make_engine(RolloutConfig(), model, tokenizer, fast=FastPaths.resolve("auto"))
        .generate(prompts, args.group, sampling, end_of_turn_ids(tokenizer), seed=2)
        .rollout
    )
    result["training"] = bench_training(model, rollout, args, device)
    del model
    return result


def markdown(results: list[dict], gpu: str, peak: float | None) -> str:
    lines = [
        f"GPU: {gpu}; bf16 peak {peak or 'unknown'} TFLOP/s",
        "",
        "| architecture | HF tokens/s | vLLM tokens/s | vLLM / HF | train step s | MFU | peak GiB (train) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        speed = {g["engine"]: g.get("tokens_per_s") for g in r["generation"]}
        hf, vllm = speed.get("hf"), speed.get("vllm")
        ratio = f"{vllm / hf:.1f}x" if hf and vllm else "-"
        train = r["training"]
        mfu = f"{100 * train['mfu']:.1f} %" if train.get("mfu") is not None else "-"
        hf_text, vllm_text = (f"{v:.0f}" if v else "-" for v in (hf, vllm))
        lines.append(
            f"| {r['architecture']} | {hf_text} | {vllm_text} | {ratio} | {train['step_s']:.2f} "
            f"| {mfu} | {train['peak_memory_gib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: no CUDA device found; the full GPU benchmark needs one. "
            "Run it on a GPU machine, or use --smoke for the CPU smoke run.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = peak_tflops(device, args.peak_tflops)
    results = [bench_architecture(name, args, device) for name in args.architectures]
    for r in results:
        train = r["training"]
        train["mfu"] = train["tflops_per_s"] / peak if peak else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke run)"
    report = {
        "gpu": gpu,
        "bf16_peak_tflops": peak,
        "smoke": args.smoke,
        "prompts": args.prompts,
        "group": args.group,
        "tokens": args.tokens,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(results, gpu, peak))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
