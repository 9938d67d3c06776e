"""Seconds per GRPO optimizer step: the project's step against TRL's ``GRPOTrainer``, side by side.

    python -m benchmarks.grpo_step --reps 3            # prepares bench/project if needed, then measures
    python -m benchmarks.grpo_step --smoke             # one step of each project variant (what CI runs)
    python -m benchmarks.grpo_step --params configs/smollm2.yaml   # a real model: the profile's SFT model

``--params`` prepares the project from a profile (its model, SFT and data settings; the project folder
is ``bench/<profile name>``), so the same workload runs on a pretrained model. ``--profile`` adds a
torch profiler table of one more project step, after the timed ones (the operators where its time goes).

Same work for every variant: the project's SFT model, its own prompts of both tasks, 8 prompts x 4
completions, up to 32 new tokens, beta 0.04, loss ``grpo``, LoRA r 8 on q/k/v/o, sampling at
temperature 1 without top-k/top-p. Each (repetition, variant) runs in a fresh process from the
same SFT weights and a fresh adapter, variants interleaved within each repetition (the order
rotating from one repetition to the next), so machine load drifts hit every variant alike. TRL
(``pip install -e .[bench]``) runs when it is installed, in fp32 and with its default bf16
autocast, each also with the C allocator set as the project's CPU stages set it
(``device.retain_freed_memory``, the ``-retain`` variants); its fastest is the reference of
``speedup_vs_trl``. The project runs as params.yaml ships
it (``grpo.bf16``); ``project-sum-bf16`` runs its step under bf16 autocast on a CPU with native bf16;
``project-sum-off`` runs ``sum`` with ``model.fast_paths: off`` (the libraries' own paths).
``--full-length`` forces every completion to the full 32 tokens (eos suppressed before that).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.workers import WORKLOAD
from grpo.config import load_config
from grpo.model.precision import cpu_has_native_bf16

ROOT = Path(__file__).resolve().parents[1]
PROJECT_VARIANTS = ("project-sum", "project-cagrad", "project-sum-off")
BF16_VARIANTS = ("project-sum-bf16",)
PLAIN_VARIANTS = ("plain-sum", "plain-cagrad")


def prepare(project: Path, sft_epochs: int | None, n_train: int, profile: Path | None = None) -> Path:
    """``project/params.yaml`` (params.yaml, or a profile over it) and its data, base and SFT model,
    built once with the project's CLI."""
    params = project / "params.yaml"
    if (project / "models" / "sft" / "config.json").is_file():
        return params
    if profile is None:
        tree = yaml.safe_load((ROOT / "params.yaml").read_text())
        tree["data"]["n_train"] = n_train
        tree["sft"]["epochs"] = sft_epochs or tree["sft"]["epochs"]
    else:
        tree = {"extends": str(profile.resolve()), "data": {"n_train": n_train}}
        tree |= {"sft": {"epochs": sft_epochs}} if sft_epochs else {}
    tree["tracking"] = {**tree.get("tracking", {}), "wandb": "disabled"}
    project.mkdir(parents=True, exist_ok=True)
    params.write_text(yaml.safe_dump(tree, sort_keys=False))
    for stage in ("prepare", "base", "sft"):
        print(f"bench: preparing {project}: grpo {stage}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "grpo.cli", stage, "--params", "params.yaml"], cwd=project, check=True
        )
    return params


def run_worker(
    project: Path, variant: str, steps: int, warmup: int, full_length: bool, profile: bool = False
) -> dict:
    """One variant in a fresh process (its own peak RSS, nothing cached from another variant)."""
    command = [sys.executable, "-m", "benchmarks.workers", variant, str(project), str(steps), str(warmup)]
    command += (["--full-length"] if full_length else []) + (["--profile"] if profile else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench: variant {variant} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """Median/min/max seconds per step over every timed step of every repetition of one variant."""
    times = [t for run in runs for t in run["step_s"]]
    tokens = [n for run in runs for n in run["completion_tokens"]]
    out = {
        "step_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "steps": len(times),
        "completion_tokens_per_s": sum(tokens) / sum(times),
        "mean_completion_tokens": sum(tokens) / len(tokens) / WORKLOAD["rows"],
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
    }
    phases = [run["phases"] for run in runs if run.get("phases")]
    if phases:
        out["phases_s"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    profiles = [run["profile"] for run in runs if run.get("profile")]
    if profiles:
        out["profile"] = profiles[0]
    decode = [ms for run in runs for ms in run.get("decode_ms_per_step", [])]
    if decode:  # the rollout's seconds over its decode steps (the longest completion), all rows at once
        out["decode_ms_per_step"] = statistics.median(decode)
        out["decode_rows"] = WORKLOAD["rows"]
    return out


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_bf16": cpu_has_native_bf16(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in load],
    }


def results(summary: dict[str, dict], args: argparse.Namespace, info: dict) -> dict:
    trl = {name: s["step_s"] for name, s in summary.items() if name.startswith("trl-")}
    best = min(trl, key=trl.get) if trl else None
    speedup = {
        name: trl[best] / s["step_s"] for name, s in summary.items() if best and not name.startswith("trl-")
    }
    both = "project-cagrad" in summary and "project-sum" in summary
    ratio = summary["project-cagrad"]["step_s"] / summary["project-sum"]["step_s"] if both else None
    return {
        "workload": {**WORKLOAD, "full_length": args.full_length},
        "reps": args.reps,
        "steps_per_rep": args.steps,
        "model": args.model_name,
        "machine": info,
        "variants": summary,
        "trl_reference": best,
        "speedup_vs_trl": speedup,
        "cagrad_over_sum": ratio,
    }


def print_table(out: dict) -> None:
    print(f"\nGRPO step on {out['model']}, {out['workload']}\nmachine: {out['machine']}")
    print(
        f"{'variant':<16}{'median s':>10}{'min':>8}{'max':>8}{'tok/s':>8}{'len':>6}{'RSS MB':>8}{'vs TRL':>8}"
    )
    for name, s in out["variants"].items():
        ratio = out["speedup_vs_trl"].get(name)
        print(
            f"{name:<16}{s['step_s']:>10.3f}{s['min_s']:>8.3f}{s['max_s']:>8.3f}{s['completion_tokens_per_s']:>8.1f}"
            f"{s['mean_completion_tokens']:>6.1f}{s['peak_rss_mb']:>8.0f}{(f'{ratio:.2f}x' if ratio else '-'):>8}"
        )
        if "phases_s" in s:
            print("    phases: " + ", ".join(f"{k} {v:.3f}s" for k, v in s["phases_s"].items()))
        if "decode_ms_per_step" in s:
            print(
                f"    decode: {s['decode_ms_per_step']:.1f} ms per step of {s['decode_rows']} rows (rollout / its steps)"
            )
    if out["trl_reference"]:
        print(
            f"speedup_vs_trl (TRL at its best: {out['trl_reference']}): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in out["speedup_vs_trl"].items())
        )
    if out["cagrad_over_sum"]:
        print(f"cagrad / sum step time: {out['cagrad_over_sum']:.2f}")


def write_results(path: Path, out: dict) -> None:
    """``out`` as indented JSON at ``path`` (its folder made), and a line saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"bench: wrote {path}")


def variants(args: argparse.Namespace) -> list[str]:
    chosen = list(PROJECT_VARIANTS) + ([] if args.smoke or args.no_plain else list(PLAIN_VARIANTS))
    chosen += list(BF16_VARIANTS) if cpu_has_native_bf16() and not args.smoke else []
    if importlib.util.find_spec("trl") is None:
        print("bench: trl is not installed (pip install -e .[bench]): TRL variants skipped", flush=True)
    elif not args.smoke or args.with_trl:
        trl = ["trl-fp32"] + (["trl-bf16"] if cpu_has_native_bf16() else [])
        chosen += trl + ([f"{name}-retain" for name in trl] if not args.smoke else [])
    if args.variants:
        unknown = sorted(set(args.variants) - set(chosen))
        if unknown:
            raise SystemExit(f"bench: --variants {', '.join(unknown)}: not among this run's ({', '.join(chosen)})")
        chosen = [name for name in chosen if name in args.variants]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every variant")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repetition")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument(
        "--project",
        type=Path,
        default=None,
        help="project folder (default: bench/project, or bench/<profile name> with --params)",
    )
    parser.add_argument(
        "--params",
        type=Path,
        default=None,
        help="a profile (e.g. configs/smollm2.yaml): benchmark its model instead of the tiny one",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print a torch profiler table of one step of each project variant",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--full-length", action="store_true", help="force all 32 completion tokens")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain (levers off) project path")
    parser.add_argument(
        "--smoke", action="store_true", help="one step of each project variant, one repetition"
    )
    parser.add_argument("--with-trl", action="store_true", help="in --smoke, run TRL too when installed")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="run only these variants (e.g. project-sum project-sum-off trl-bf16-retain): more repetitions "
        "of the figures that matter in the same time",
    )
    parser.add_argument(
        "--sft-epochs",
        type=int,
        default=None,
        help="SFT epochs when the project must be prepared (default: params.yaml's)",
    )
    parser.add_argument("--n-train", type=int, default=2000, help="training records when it must be prepared")
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.steps, args.warmup = 1, 1, 0
    info = machine()
    project = args.project or ROOT / "bench" / (args.params.stem if args.params else "project")
    params = prepare(project.resolve(), args.sft_epochs, args.n_train, args.params)
    args.model_name = str(load_config(params).model.name_or_path or "the embedded tiny model")
    names = variants(args)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        # Each repetition starts one variant later: no variant always runs first (cold caches) or
        # always right after the memory-hungry TRL runs.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            print(f"bench: repetition {rep + 1}/{args.reps}: {name}", flush=True)
            profile = args.profile and rep == 0 and not name.startswith("trl-")
            runs[name].append(
                run_worker(params.parent, name, args.steps, args.warmup, args.full_length, profile)
            )
            if runs[name][-1].get("profile"):
                print(
                    f"bench: where one step of {name} spends its time\n{runs[name][-1]['profile']}",
                    flush=True,
                )
    out = results({name: summarise(r) for name, r in runs.items()}, args, info)
    out["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print_table(out)
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
