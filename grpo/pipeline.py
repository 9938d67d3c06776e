"""``grpo pipeline``: every stage in order, in one process, without DVC (``dvc repro`` is the
incremental way: it reruns only what is stale). Same library functions, same files."""

from __future__ import annotations

import importlib
import time

from grpo.config import Config
from grpo.eval.keymetrics import write_key_metrics
from grpo.provenance import stages


def run(cfg: Config) -> int:
    timings = {}
    for spec in stages.STAGES.values():
        module, _, func = spec.entry.partition(":")
        started = time.perf_counter()
        code = getattr(importlib.import_module(module), func)(cfg)
        timings[spec.name] = time.perf_counter() - started
        if code:
            print(f"pipeline: stage {spec.name} exited {code}; later stages not run")
            return code
        write_key_metrics(cfg, spec.name)
    print("pipeline: " + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in timings.items()))
    return 0
