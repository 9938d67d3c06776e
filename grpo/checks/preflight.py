"""Stage ``preflight``: the invariants I1-I12 checked on the code the stages run, with the configured model.

Every check (``grpo/checks/invariants.py``) drives a stage's own function with probes built to expose
its bug class, on the policy exactly as ``train.policy.build_policy`` builds it; each reports the number
it compared and the bound.

It writes ``reports/preflight.json`` (each check, its status, value and bound) together with the
lineage it was run for; ``grpo train`` refuses to start unless a passing report exists for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo import paths
from grpo.checks.behaviour import (
    check_first_step,
    check_processors_see_completion,
    check_sft_ends_answers,
    check_sft_supervises_stop,
)
from grpo.checks.fast_paths import check_fast_paths
from grpo.checks.gated import Gated, gate_step
from grpo.checks.invariants import FUNCTION_CHECKS
from grpo.checks.probes import Check
from grpo.checks.step_agreement import check_step_agreement
from grpo.config import Config
from grpo.errors import GrpoError
from grpo.files import write_atomically
from grpo.provenance.gate import REPORT_NAME, PreflightError, preflight_lineage

CHECKS: tuple[Callable[[Gated], Check], ...] = (
    *FUNCTION_CHECKS,
    check_sft_supervises_stop,
    check_sft_ends_answers,
    check_processors_see_completion,
    check_first_step,
    check_step_agreement,
    check_fast_paths,
)
"""Every check of the gate: one per stage function (``invariants.py``), then the behaviour of the stage
code whichever way it is written (``behaviour.py``, ``step_agreement.py``), and the fast paths against the
library's (``fast_paths.py``)."""


def report_path(cfg: Config) -> Path:
    return paths.report_file(cfg, REPORT_NAME)


def declared_invariants(check) -> str:
    """The invariants a check's docstring opens with (``"I3, I4, I11: ..."``): what a crash of the stage
    code it drives is reported under."""
    lead = (check.__doc__ or "").strip().split(":", 1)[0]
    return lead if re.fullmatch(r"I\d+(?:[-–]I?\d+)?(?:, I\d+(?:[-–]I?\d+)?)*", lead) else ""


def run_checks_on(subject: Gated) -> list[Check]:
    """Every check; one that raises (a project error, or a crash of the stage code it drives) counts as
    failed, with the error as its detail, so the report is always written and names every check."""
    checks = []
    for check in CHECKS:
        try:
            checks.append(check(subject))
        except GrpoError as exc:  # a run-time invariant of the step it drives names its invariant
            name = check.__name__.removeprefix("check_")
            invariant = getattr(exc, "invariant", "") or declared_invariants(check)
            checks.append(Check(name, "fail", None, str(exc), "see the error", invariant))
        except Exception as exc:  # noqa: BLE001 - a check that crashes on the stage code is a failed check
            checks.append(
                Check(
                    check.__name__.removeprefix("check_"),
                    "fail",
                    None,
                    f"the check raised {type(exc).__name__}: {exc}",
                    "the stage code it drives broke",
                    declared_invariants(check),
                )
            )
    return checks


def run_checks(cfg: Config) -> dict[str, Any]:
    """The checks on the step exactly as the trainer builds it (``gated.gate_step``: ``build_policy``, then
    ``build_step``), with a fresh load of the SFT weights and the base to compare the reference with."""
    checks = run_checks_on(gate_step(cfg))
    return {
        "passed": all(c.passed for c in checks),
        "checks": [c.as_dict() for c in checks],
        "lineage": preflight_lineage(cfg),
    }


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _bound(check: dict[str, Any]) -> str:
    return f"{_cell(check['bound'])} {check.get('unit', '')}".strip()


def _row(*texts: str) -> str:
    """A markdown table row; a pipe in a value or detail (``|logp|``) is escaped, or it would split the cell."""
    return "| " + " | ".join(text.replace("|", "\\|") for text in texts) + " |"


def write_report(cfg: Config, report: dict[str, Any]) -> None:
    path = report_path(cfg)
    rows = [
        "| check | invariant | status | value | bound | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows += [
        _row(c["name"], c["invariant"], c["status"], _cell(c["value"]), _bound(c), c["detail"])
        for c in report["checks"]
    ]
    write_atomically(
        {
            path: json.dumps(report, indent=2, default=str) + "\n",
            path.with_suffix(".md"): "# Pre-flight\n\n" + "\n".join(rows) + "\n",
        }
    )


def run(cfg: Config) -> int:
    report = run_checks(cfg)
    write_report(cfg, report)
    for c in report["checks"]:
        print(
            f"preflight: {c['status']:<4}  {c['name']:<24} {c['invariant']:<12} value {_cell(c['value'])} "
            f"(bound {_cell(c['bound'])}) {c['detail']}"
        )
    if not report["passed"]:
        raise PreflightError(f"pre-flight failed; see {report_path(cfg)} for the numbers")
    return 0
