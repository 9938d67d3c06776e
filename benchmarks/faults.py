"""Fault driver: GRPO training killed with SIGKILL and rerun, as an operator meets it; prints the tally.

    python -m benchmarks.faults                       # 20 kills at random moments, 9 kills inside a save
    python -m benchmarks.faults --kills 5 --save-kills 3 --steps 6 --out faults.json

The tiny project (data, base, SFT, pre-flight; tests/tiny_project.py) is prepared once; one
uninterrupted ``grpo train`` gives the reference weights. Then each trial copies the project and:

- *kill*: starts ``grpo train``, SIGKILLs its whole process group at a random moment of the run (after
  a seeded random number of logged steps, plus a random fraction of a step), reruns ``grpo train`` to
  the end;
- *save-kill*: SIGKILLs it while a checkpoint is being written (the moment a ``.tmp-step-`` folder
  appears in the run folder), reruns it to the end.

A trial counts as clean when the rerun exits 0, its adapter equals the reference bit for bit, and its
``metrics.jsonl`` holds every step once, in order. A save-kill trial also records whether the rerun
resumed from the checkpoint before the interrupted one (the half-written one skipped). Nothing here is
timed: the tally, not the seconds, is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.tiny_project import copy_prepared as copy_project
from tests.tiny_project import prepared_project

GRPO = str(Path(sys.executable).with_name("grpo"))
TMP_PREFIX = ".tmp-step-"


def start_train(params: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([GRPO, "train", "--params", str(params)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def adapter(params: Path) -> dict[str, torch.Tensor]:
    return load_file(str(params.parent / "models" / "grpo" / "adapter_model.safetensors"))


def run_dir(params: Path) -> Path:
    return params.parent / "runs" / "tiny"


def kill_group(proc: subprocess.Popen) -> bool:
    """SIGKILL the run's process group; False when it had already finished."""
    if proc.poll() is not None:
        return False
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return True


def kill_after(proc: subprocess.Popen, folder: Path, steps_done: int, delay: float) -> bool:
    """Kill ``delay`` seconds after the run logged its ``steps_done``-th step (0: after it started)."""
    metrics = folder / "metrics.jsonl"
    while proc.poll() is None:
        logged = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        if logged >= steps_done:
            break
        time.sleep(0.005)
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    return kill_group(proc)


def kill_in_save(proc: subprocess.Popen, folder: Path, skip: int) -> tuple[bool, int | None]:
    """Kill when the ``skip+1``-th checkpoint save is in progress; returns (killed, its step)."""
    seen: set[str] = set()
    while proc.poll() is None:
        if folder.is_dir():
            for tmp in folder.glob(f"{TMP_PREFIX}*"):
                if tmp.name not in seen and "-old-" not in tmp.name:
                    seen.add(tmp.name)
                    if len(seen) > skip:
                        step = int(tmp.name[len(TMP_PREFIX):].split("-")[0])
                        return kill_group(proc), step
        time.sleep(0.001)
    return False, None


def verdict(params: Path, reference: dict[str, torch.Tensor], steps: int, output: str, code: int) -> dict:
    lines = (run_dir(params) / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in lines]
    same = False
    if code == 0:
        weights = adapter(params)
        same = weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    resumed = next((line.split("(step ", 1)[1].rstrip(")") for line in output.splitlines()
                    if line.startswith("grpo: resuming from")), None)
    return {"exit": code, "bit_identical": same, "metrics_steps_once": logged == list(range(1, steps + 1)),
            "resumed_from": resumed, "clean": code == 0 and same and logged == list(range(1, steps + 1))}


def trial(base: Path, dest: Path, reference: dict, steps: int, kill) -> dict:
    params = copy_project(base, dest)
    proc = start_train(params)
    killed, detail = kill(proc, run_dir(params))
    rerun = start_train(params)
    output = rerun.communicate(timeout=900)[0].decode()
    out = {"killed": killed, **detail, **verdict(params, reference, steps, output, rerun.returncode)}
    if not out["clean"]:
        out["output_tail"] = output[-2000:]
    shutil.rmtree(dest, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--save-kills", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps of each run (a checkpoint each)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    parser.add_argument("--out", type=Path, help="write the trials as JSON here")
    args = parser.parse_args(argv)
    draw = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="grpo-faults-") as scratch:
        root = Path(scratch)
        base = prepared_project(root / "base", grpo={"steps": args.steps}, checkpoint={"every": 1, "keep_last": 3})
        straight = copy_project(base, root / "straight")
        began = time.monotonic()
        proc = start_train(straight)
        output = proc.communicate(timeout=900)[0].decode()
        duration = time.monotonic() - began
        if proc.returncode != 0:
            print(output[-3000:])
            return 1
        reference = adapter(straight)
        trials = []
        step_s = duration / (args.steps + 2)  # a rough step, so a kill lands inside the next one
        for i in range(args.kills):
            done, delay = draw.randrange(args.steps), draw.uniform(0.0, step_s)

            def at(p, folder, done=done, delay=delay):
                return kill_after(p, folder, done, delay), {"kind": "kill", "after_step": done,
                                                            "delay_s": round(delay, 2)}

            result = trial(base, root / f"kill-{i}", reference, args.steps, at)
            trials.append(result)
            print(f"kill {i + 1}/{args.kills} {delay:.2f}s after step {done}: killed={result['killed']} "
                  f"clean={result['clean']} resumed from {result['resumed_from']}", flush=True)
        for i in range(args.save_kills):
            skip = i % max(1, args.steps - 1)

            def in_save(p, folder, skip=skip):
                killed, step = kill_in_save(p, folder, skip)
                return killed, {"kind": "save-kill", "save_of_step": step}

            result = trial(base, root / f"save-{i}", reference, args.steps, in_save)
            trials.append(result)
            print(f"save-kill {i + 1}/{args.save_kills} in the save of step {result['save_of_step']}: "
                  f"killed={result['killed']} clean={result['clean']} resumed from {result['resumed_from']}",
                  flush=True)
    tally = {}
    for kind in ("kill", "save-kill"):
        mine = [t for t in trials if t["kind"] == kind]
        tally[kind] = {"trials": len(mine), "killed": sum(t["killed"] for t in mine),
                       "clean": sum(t["clean"] for t in mine)}
    print(json.dumps({"reference_run_s": round(duration, 1), "steps": args.steps, "tally": tally}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"tally": tally, "trials": trials}, indent=1))
    return 0 if all(t["clean"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
