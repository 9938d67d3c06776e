"""Stage ``preflight``: the invariants I1-I12 checked on the code the stages run, with the configured model.

Every check (``grpo/checks/invariants.py``) drives a stage's own function with probes built to expose
its bug class, on the policy exactly as ``trainer.build_policy`` builds it; each reports the number
it compared and the bound.

It writes ``reports/preflight.json`` (each check, its status, value and bound) together with the
lineage it was run for; ``grpo train`` refuses to start unless a passing report exists for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpo.checks.invariants import CHECKS
from grpo.checks.probes import Check
from grpo.checks.subject import Subject, make_subject
from grpo.config import Config
from grpo.data.jsonl import read_records
from grpo.errors import GrpoError
from grpo.model.base import base_dir
from grpo.model.modeling import load_model
from grpo.provenance.lineage import make_lineage
from grpo.train.sft import sft_dir

LINEAGE_KEYS = ("code_fingerprint", "params_hash", "inputs")


class PreflightError(GrpoError):
    """The pre-flight checks failed or are missing for the current code, params and model."""


def report_path(cfg: Config) -> Path:
    return Path(cfg.paths.reports_dir) / "preflight.json"


def preflight_inputs(cfg: Config) -> dict[str, Path]:
    return {"base": base_dir(cfg), "sft": sft_dir(cfg)}


def run_checks_on(subject: Subject) -> list[Check]:
    """Every check; one that raises a project error counts as failed, with the error as its detail."""
    checks = []
    for check in CHECKS:
        try:
            checks.append(check(subject))
        except GrpoError as exc:
            checks.append(Check(check.__name__.removeprefix("check_"), "fail", None, str(exc), "see the error"))
    return checks


def run_checks(cfg: Config) -> dict[str, Any]:
    """The checks on the policy exactly as the trainer builds it (``build_policy``: LoRA on models/sft)."""
    from grpo.train.trainer import build_policy  # here: the trainer imports this module for its gate

    policy = build_policy(cfg, torch.device("cpu"))
    records = read_records(Path(cfg.paths.data_dir) / "train.jsonl")
    sft, base = load_model(sft_dir(cfg), cfg.model), load_model(base_dir(cfg), cfg.model)
    checks = run_checks_on(make_subject(cfg, policy.model, policy.tokenizer, records, sft, base))
    lineage = make_lineage("preflight", cfg, preflight_inputs(cfg))
    return {"passed": all(c.passed for c in checks), "checks": [c.as_dict() for c in checks],
            "lineage": {key: lineage[key] for key in LINEAGE_KEYS}}


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def write_report(cfg: Config, report: dict[str, Any]) -> None:
    path = report_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    rows = ["| check | invariant | status | value | bound | detail |", "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {c['name']} | {c['invariant']} | {c['status']} | {_cell(c['value'])} | {_cell(c['bound'])} | "
             f"{c['detail']} |" for c in report["checks"]]
    path.with_suffix(".md").write_text("# Pre-flight\n\n" + "\n".join(rows) + "\n")


def require_preflight(cfg: Config) -> None:
    """Refuse to train without a passing pre-flight for the current code, params and SFT model."""
    path = report_path(cfg)
    how = "run `grpo preflight` (or `dvc repro preflight`) first"
    if not path.is_file():
        raise PreflightError(f"{path} does not exist: GRPO needs a passing pre-flight; {how}")
    report = json.loads(path.read_text())
    if not report.get("passed"):
        failed = [c["name"] for c in report.get("checks", []) if not c["passed"]]
        raise PreflightError(f"{path}: pre-flight failed ({', '.join(failed)}); fix them, then {how}")
    current = make_lineage("preflight", cfg, preflight_inputs(cfg))
    changed = [key for key in LINEAGE_KEYS if report.get("lineage", {}).get(key) != current[key]]
    if changed:
        raise PreflightError(f"{path} was made for other {', '.join(changed)} than the current ones; {how}")


def run(cfg: Config, args=None) -> int:
    report = run_checks(cfg)
    write_report(cfg, report)
    for c in report["checks"]:
        print(f"preflight: {c['status']:<4}  {c['name']:<24} {c['invariant']:<12} value {_cell(c['value'])} "
              f"(bound {_cell(c['bound'])}) {c['detail']}")
    if not report["passed"]:
        raise PreflightError(f"pre-flight failed; see {report_path(cfg)} for the numbers")
    return 0
