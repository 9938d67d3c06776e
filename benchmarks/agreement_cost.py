"""What the run-time agreement checks cost a GRPO step: the same step with them on and off, in one process.

    python -m benchmarks.agreement_cost --pairs 10                      # the tiny project (bench/project)
    python -m benchmarks.agreement_cost --params configs/smollm2.yaml   # a real model: the profile's SFT model

"On" is the step as the trainer runs it: the decode records what it computed for each drawn token
(``generation.record_draw``, ``stack_records``) and the step holds the scorer to it (``agreement.step_checks``).
"Off" takes both out (the rollout carries no record, the check is a no-op). The workload is
``benchmarks.workers.WORKLOAD`` (``project-sum``), on the project's SFT model under a fresh adapter.

Two figures, because a few percent is within the spread of step times on a shared machine:

- on/off per pair: steps alternate on, off (the order swapped each pair) after warm-up steps, and each pair's
  ratio is taken, so a drift of the machine's speed hits both members alike;
- the share of an "on" step spent inside the added code itself (the record per token, its stacking and the
  check), timed around those functions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import grpo.model.engines as engines
import grpo.model.fast.decode as decode_module
import grpo.model.generation as generation_module
import grpo.model.rollout as rollout_module
import grpo.train.step as step_module
from benchmarks.grpo_step import ROOT, machine, prepare, write_results
from benchmarks.workers import project_step, step_records

REAL = {
    "sample_rollout": engines.sample_rollout,
    "step_checks": step_module.step_checks,
    "record_draw": decode_module.record_draw,
    "generation_record_draw": generation_module.record_draw,
    "stack_records": rollout_module.stack_records,
}


def _without_record(*args, **kwargs):
    return REAL["sample_rollout"](*args, **{**kwargs, "with_sampler": False})


def _unchecked(step, batch, first):
    return lambda policy: {}


def set_checks(on: bool) -> None:
    """The trainer's step (``on``) or the step without the record and the check."""
    engines.sample_rollout = REAL["sample_rollout"] if on else _without_record
    step_module.step_checks = REAL["step_checks"] if on else _unchecked


class Timer:
    """Seconds spent inside the wrapped functions since the last ``reset``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - started

        return timed

    def install(self) -> None:
        decode_module.record_draw = self.wrap(REAL["record_draw"])
        generation_module.record_draw = self.wrap(REAL["generation_record_draw"])
        rollout_module.stack_records = self.wrap(REAL["stack_records"])
        step_module.step_checks = lambda step, batch, first: self.wrap(REAL["step_checks"](step, batch, first))


def measure(project: Path, pairs: int, warmup: int, full_length: bool) -> dict:
    cfg, step = project_step(project, "project-sum", full_length)
    batches = step_records(cfg, warmup + 3 * pairs + 1)
    numbers = iter(range(1, len(batches) + 1))

    def one(on: bool) -> float:
        set_checks(on)
        index = next(numbers)
        records = batches[index - 1]
        started = time.perf_counter()
        step_module.grpo_step(step, records, index, lambda attempt, r=records: r)
        return time.perf_counter() - started

    for i in range(warmup):  # the first step (a fresh run's ratio-1 check) among them
        one(i % 2 == 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for on in (True, False) if i % 2 == 0 else (False, True):
            times[on].append(one(on))
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    timer, shares = Timer(), []
    set_checks(True)
    timer.install()
    for _ in range(pairs):
        timer.spent = 0.0
        index = next(numbers)
        records = batches[index - 1]
        started = time.perf_counter()
        step_module.grpo_step(step, records, index, lambda attempt, r=records: r)
        shares.append(timer.spent / (time.perf_counter() - started))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "on_median_s": statistics.median(times[True]),
        "off_median_s": statistics.median(times[False]),
        "on_over_off": {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
                        "min": min(ratios), "max": max(ratios), "pairs": pairs},
        "share_inside": {"median": statistics.median(shares), "min": min(shares), "max": max(shares),
                         "steps": pairs},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=10, help="on/off pairs (and 'on' steps timed inside)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--params", type=Path, default=None, help="a profile (e.g. configs/smollm2.yaml)")
    parser.add_argument("--project", type=Path, default=None,
                        help="project folder (default: bench/project, or bench/<profile name> with --params)")
    parser.add_argument("--full-length", action="store_true", help="force all 32 completion tokens")
    parser.add_argument("--n-train", type=int, default=2000, help="training records when it must be prepared")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "agreement_cost.json")
    args = parser.parse_args(argv)
    info = machine()
    project = args.project or ROOT / "bench" / (args.params.stem if args.params else "project")
    params = prepare(project.resolve(), None, args.n_train, args.params)
    out = {"project": str(params.parent), "machine": info,
           **measure(params.parent, args.pairs, args.warmup, args.full_length)}
    ratio, share = out["on_over_off"], out["share_inside"]
    print(f"checks on {out['on_median_s']:.3f} s, off {out['off_median_s']:.3f} s (medians)")
    print(f"on/off per pair: median {ratio['median']:.4f} (quartiles {ratio['q1']:.4f}..{ratio['q3']:.4f}; "
          f"{ratio['min']:.4f}..{ratio['max']:.4f}) over {ratio['pairs']} pairs")
    print(f"inside the record and the check: {100 * share['median']:.2f} % of the step "
          f"({100 * share['min']:.2f}..{100 * share['max']:.2f} %) over {share['steps']} steps")
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
