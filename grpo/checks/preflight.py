"""Stage ``preflight``: the invariants I1-I12 checked on the code the stages run, with the configured model.

Every check (``grpo/checks/invariants.py``) drives a stage's own function with probes built to expose
its bug class, on the policy exactly as ``train.policy.build_policy`` builds it; each reports the number
it compared and the bound.

It writes ``reports/preflight.json`` (each check, its status, value and bound) together with the
lineage it was run for; ``grpo train`` refuses to start unless a passing report exists for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpo import paths
from grpo.checks.invariants import CHECKS
from grpo.checks.probes import Check
from grpo.checks.subject import Subject, make_subject
from grpo.config import Config
from grpo.data.select import train_records
from grpo.errors import GrpoError
from grpo.files import write_atomically
from grpo.model.load import load_base
from grpo.model.modeling import load_model
from grpo.provenance.gate import REPORT_NAME, PreflightError, preflight_lineage
from grpo.train.policy import build_policy, frozen_copy


def report_path(cfg: Config) -> Path:
    return paths.report_file(cfg, REPORT_NAME)


def run_checks_on(subject: Subject) -> list[Check]:
    """Every check; one that raises (a project error, or a crash of the stage code it drives) counts as
    failed, with the error as its detail, so the report is always written and names every check."""
    checks = []
    for check in CHECKS:
        try:
            checks.append(check(subject))
        except GrpoError as exc:
            checks.append(Check(check.__name__.removeprefix("check_"), "fail", None, str(exc), "see the error"))
        except Exception as exc:  # noqa: BLE001 - a check that crashes on the stage code is a failed check
            checks.append(Check(check.__name__.removeprefix("check_"), "fail", None,
                                f"the check raised {type(exc).__name__}: {exc}", "the stage code it drives broke"))
    return checks


def run_checks(cfg: Config) -> dict[str, Any]:
    """The checks on the policy and reference exactly as the trainer builds them (``build_policy``: LoRA
    on models/sft, or every weight of it against a frozen copy). With LoRA off and ``beta == 0`` the
    trainer keeps no reference; the I8/I9 check still probes one (it raises beta), so it gets the copy
    ``build_policy`` makes when beta > 0."""
    policy = build_policy(cfg, torch.device("cpu"))
    reference = policy.reference
    if reference is None and not cfg.model.lora.enabled:
        reference = frozen_copy(policy.model)
    records = train_records(cfg, "grpo")
    sft = load_model(paths.model_dir(cfg, "sft"), cfg.model)
    base, _ = load_base(cfg)
    checks = run_checks_on(make_subject(cfg, policy.model, policy.tokenizer, records, sft, base, reference))
    return {"passed": all(c.passed for c in checks), "checks": [c.as_dict() for c in checks],
            "lineage": preflight_lineage(cfg)}


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def write_report(cfg: Config, report: dict[str, Any]) -> None:
    path = report_path(cfg)
    rows = ["| check | invariant | status | value | bound | detail |", "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {c['name']} | {c['invariant']} | {c['status']} | {_cell(c['value'])} | {_cell(c['bound'])} | "
             f"{c['detail']} |" for c in report["checks"]]
    write_atomically({path: json.dumps(report, indent=2, default=str) + "\n",
                      path.with_suffix(".md"): "# Pre-flight\n\n" + "\n".join(rows) + "\n"})


def run(cfg: Config) -> int:
    report = run_checks(cfg)
    write_report(cfg, report)
    for c in report["checks"]:
        print(f"preflight: {c['status']:<4}  {c['name']:<24} {c['invariant']:<12} value {_cell(c['value'])} "
              f"(bound {_cell(c['bound'])}) {c['detail']}")
    if not report["passed"]:
        raise PreflightError(f"pre-flight failed; see {report_path(cfg)} for the numbers")
    return 0
