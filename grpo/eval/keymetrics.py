"""The key numbers of each stage, one small file per number, for ``dvc metrics show`` and ``dvc metrics diff``.

The full reports (``reports/validation.json``, ``metrics/sft.json``, ``reports/preflight.json``,
``metrics/grpo.json``, ``metrics/eval.json``) are nested and long: as DVC metrics they made
``dvc metrics show`` print rows of thousands of characters. Each stage therefore also writes
``<metrics_dir>/key/<stage>/``: a handful of numbers (the README's key rows), which is all dvc.yaml
declares as metrics; the full report stays beside it as a plain output.

One file per number, ``<name>.json`` holding ``{"value": x}`` (the evaluation's rows hold one value
per model, ``{"base": x, "sft": y, "grpo": z}``): ``dvc metrics show`` prints one row per file and one
column per key, so this layout is a few narrow columns (``base grpo sft value``) and one row per
number, where one file per stage made a column of every number. Written by the CLI (``grpo <stage>``
and ``grpo pipeline``) after the stage succeeds, from the report the stage wrote.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.eval.metrics import KEY_ROWS


def _pick(*keys: str) -> Callable[[dict, Path], dict]:
    return lambda report, folder: {key: report.get(key) for key in keys}


def _validation(report: dict, folder: Path) -> dict:
    return {
        "passed": report["success"],
        "rows": report["n_rows"],
        "rules": report["n_rules"],
        "failed_rules": report["n_failed"],
    }


def _preflight(report: dict, folder: Path) -> dict:
    checks = report.get("checks", [])
    return {"passed": report["passed"], "checks": len(checks), "failed": sum(not c["passed"] for c in checks)}


def _evaluation(report: dict, folder: Path) -> dict:
    """``{row: {model: greedy value}}`` (one file per row, the models side by side), and the verdict of each
    task per decoding (``verdict/greedy/fairness``: ``traded``) from ``eval_compare.json`` beside the report."""
    rows = {
        key: {model: modes.get("greedy", {}).get(key) for model, modes in report.items()} for key in KEY_ROWS
    }
    compare = folder / "eval_compare.json"
    judged = json.loads(compare.read_text(encoding="utf-8")).get("verdicts", {}) if compare.is_file() else {}
    verdicts = {
        f"verdict/{mode}/{task}": verdict["verdict"]
        for mode, tasks in judged.items()
        for task, verdict in tasks.items()
    }
    return verdicts | rows


KEY_METRICS: dict[str, tuple[str, str, Callable[[dict, Path], dict]]] = {
    # stage -> (paths field, full report file, key rows of it (the report and its folder))
    "validate": ("reports_dir", "validation.json", _validation),
    "sft": (
        "metrics_dir",
        "sft.json",
        _pick("loss_first", "loss_final", "token_accuracy_final", "steps", "wall_time_s"),
    ),
    "preflight": ("reports_dir", "preflight.json", _preflight),
    "grpo": (
        "metrics_dir",
        "grpo.json",
        _pick(
            "reward_first",
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            "entropy",
            "kl",
            "steps",
            "selected_step",
        ),
    ),
    "evaluate": ("metrics_dir", "eval.json", _evaluation),
}


def key_metrics_path(cfg: Config, stage: str) -> Path:
    """``<metrics_dir>/key/<stage>/``: the folder dvc.yaml declares as the stage's metrics."""
    return Path(cfg.paths.metrics_dir) / "key" / stage


def read_key_metrics(folder: Path) -> dict[str, Any]:
    """``{name: value}`` (``{name: {model: value}}`` for the evaluation's rows) of one stage's folder."""
    rows = {}
    for path in sorted(folder.rglob("*.json")):
        row = json.loads(path.read_text(encoding="utf-8"))
        rows[path.relative_to(folder).with_suffix("").as_posix()] = (
            row["value"] if set(row) == {"value"} else row
        )
    return rows


def write_key_metrics(cfg: Config, stage: str) -> Path | None:
    """``<metrics_dir>/key/<stage>/`` from the stage's full report; None when there is none to read.

    The folder is written afresh (a number the report no longer has leaves no file behind). (No
    report: a stage without one, or ``grpo train --max-steps`` that stopped before the final save.)
    """
    if stage not in KEY_METRICS:
        return None
    field, name, pick = KEY_METRICS[stage]
    full = Path(getattr(cfg.paths, field)) / name
    if not full.is_file():
        return None
    report: dict[str, Any] = json.loads(full.read_text(encoding="utf-8"))
    out = key_metrics_path(cfg, stage)
    shutil.rmtree(out, ignore_errors=True)
    for metric, value in pick(report, full.parent).items():
        path = out / f"{metric}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        row = value if isinstance(value, dict) else {"value": value}
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return out
