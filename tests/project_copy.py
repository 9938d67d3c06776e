"""Copy the project into a throwaway git repo with tiny params, for the DVC and Prefect end-to-end tests.

The copy holds what git would hold (tracked files plus untracked, not ignored ones), so it is the
project as the lead would commit it; its own params.yaml shrinks every stage to seconds on a CPU.
Commands run in it use ``tasks.dvc_stage.stage_env``: the copy's own code, the venv's tools, offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tasks.dvc_stage import stage_env

ROOT = Path(__file__).resolve().parents[1]
SKIP_PREFIXES = ("tests/", ".ci/")

TINY_PARAMS: dict[str, Any] = {
    "data": {"n_train": 16, "n_eval": 8},
    "model": {
        "tiny": {
            "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
        },
    },
    "pretrain": {"records": 16, "epochs": 1, "batch_size": 8},
    "sft": {"epochs": 1, "batch_size": 8},
    # One epoch of a 1-layer model does not learn to stop: the gate reports the share, not a failure.
    "preflight": {"min_ended_share": 0.0},
    # Selection's validation split comes out of the 16 GRPO records: 2 of each kind, scored at step 2.
    "grpo": {"group_size": 2, "steps": 2, "prompts_per_step": 2, "sampling": {"max_new_tokens": 6},
             "selection": {"records": 8, "every": 2}},
    "checkpoint": {"every": 1},
    "tracking": {"wandb": "disabled"},
    # A barely trained 1-layer model trips the health rules by design; here they only warn.
    "monitor": {
        name: {"action": "warn"}
        for name in (
            "boundary_header", "boundary_end_of_turn", "boundary_prompt_echo", "boundary_empty",
            "boundary_entropy_low", "entropy_floor", "reward_zero_std", "zero_grad",
        )
    },
    "eval": {"max_examples": 4, "samples_per_prompt": 2, "batch_size": 4},
}
"""Overrides of the project's params.yaml that make the whole pipeline run in about a minute."""

RUNNING = re.compile(r"^Running stage '([^']+)'", re.MULTILINE)


def merge(tree: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with ``overrides`` merged in, section by section (new dict; inputs untouched)."""
    out = dict(tree)
    for key, value in overrides.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def project_files(src: Path = ROOT) -> list[str]:
    """Files git would commit in ``src``: tracked (and still present) plus untracked, not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=src, check=True, capture_output=True, text=True,
    ).stdout.split("\0")
    return sorted({f for f in listed if f and not f.startswith(SKIP_PREFIXES) and (src / f).is_file()})


def write_params(project: Path, overrides: dict[str, Any]) -> None:
    """Merge ``overrides`` into ``project/params.yaml``."""
    path = project / "params.yaml"
    tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    path.write_text(yaml.safe_dump(merge(tree, overrides), sort_keys=False), encoding="utf-8")


def git(project: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True)


def copy_project(dest: Path, params: dict[str, Any] | None = None, src: Path = ROOT) -> Path:
    """A committed git repo at ``dest`` holding the project with tiny params (plus ``params``)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in project_files(src):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, target)
    for stale in ("dvc.lock", "fingerprints"):  # the source's own run state says nothing about the copy
        path = dest / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    write_params(dest, merge(TINY_PARAMS, params or {}))
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "project copy")
    return dest


def dvc(project: Path, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """``dvc <args>`` in ``project`` with the tasks' environment; output in ``.stdout`` (stderr merged)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=stage_env(project), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def stages_run(output: str) -> set[str]:
    """Names in the ``Running stage '<name>'`` lines of ``dvc repro`` output."""
    return set(RUNNING.findall(output))


def build_project(dest: Path) -> Path:
    """``copy_project`` then one full ``dvc repro``: every stage must run."""
    project = copy_project(dest)
    out = dvc(project, "repro").stdout
    if not {"prepare", "evaluate"} <= stages_run(out):
        raise AssertionError(f"the first `dvc repro` of {project} did not run every stage:\n{out[-4000:]}")
    return project


def clone(project: Path, dest: Path) -> Path:
    """An independent copy of a built project (git repo, DVC cache, models and run state included)."""
    shutil.copytree(project, dest, symlinks=True)
    return dest


def missing_stage_modules() -> list[str]:
    """Entry modules of grpo/provenance/stages.py that do not exist yet (the end-to-end tests need them all)."""
    import importlib.util

    from grpo.provenance import stages

    return [m for spec in stages.STAGES.values() for m in spec.modules if importlib.util.find_spec(m) is None]
