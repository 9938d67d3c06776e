"""grpo/checks/preflight.py, how the gate runs its checks (fast, without a project): a check that crashes on the
stage code fails, never skips, and a failed report is written and stops the command with an error."""

from __future__ import annotations

import json
import re

import pytest

from grpo.checks import preflight
from grpo.checks.probes import Check
from grpo.config import config_from_dict
from grpo.errors import GrpoError
from grpo.provenance.gate import PreflightError


def check_passes(subject):
    """I1: a check that holds."""
    return Check("passes", "pass", 0, "held", invariant="I1", bound=0)


def check_crashes(subject):
    """I3, I4: a check whose stage code raises."""
    raise IndexError("index 7 is out of bounds")


def check_refuses(subject):
    """I5: a check whose stage code refuses with a project error."""
    raise GrpoError("the stop ids are empty")


def test_a_check_that_raises_fails_with_the_error_and_its_invariants(monkeypatch):
    monkeypatch.setattr(preflight, "CHECKS", (check_passes, check_crashes, check_refuses))
    checks = preflight.run_checks_on(subject=None)
    assert [(c.name, c.status, c.invariant) for c in checks] == [
        ("passes", "pass", "I1"), ("crashes", "fail", "I3, I4"), ("refuses", "fail", "I5")]
    assert "the check raised IndexError: index 7 is out of bounds" in checks[1].detail
    assert checks[2].detail == "the stop ids are empty" and not checks[1].passed


def test_a_failed_gate_writes_its_report_and_stops_the_command(tmp_path, monkeypatch, capsys):
    cfg = config_from_dict({"paths": {"reports_dir": str(tmp_path / "reports")}})
    checks = [check_passes(None), Check("crashes", "fail", None, "the check raised IndexError", invariant="I3")]
    report = {"passed": False, "checks": [c.as_dict() for c in checks], "lineage": {}}
    monkeypatch.setattr(preflight, "run_checks", lambda cfg: report)
    with pytest.raises(PreflightError, match="pre-flight failed; see .*preflight.json"):
        preflight.run(cfg)
    written = json.loads(preflight.report_path(cfg).read_text())
    assert written["passed"] is False and [c["status"] for c in written["checks"]] == ["pass", "fail"]
    assert "preflight: fail  crashes" in capsys.readouterr().out
    monkeypatch.setattr(preflight, "run_checks", lambda cfg: {**report, "passed": True, "checks": report["checks"][:1]})
    assert preflight.run(cfg) == 0


def test_the_report_passes_only_when_every_check_passes(monkeypatch):
    monkeypatch.setattr(preflight, "gate_step", lambda cfg: None)
    monkeypatch.setattr(preflight, "preflight_lineage", lambda cfg: {"stage": "preflight"})
    monkeypatch.setattr(preflight, "CHECKS", (check_passes, check_crashes))
    report = preflight.run_checks(config_from_dict({}))
    assert report["passed"] is False and [c["passed"] for c in report["checks"]] == [True, False]
    monkeypatch.setattr(preflight, "CHECKS", (check_passes, check_passes))
    assert preflight.run_checks(config_from_dict({}))["passed"] is True


def test_a_pipe_in_a_detail_stays_inside_its_cell_of_the_markdown_report(tmp_path):
    """``|logp|`` in a detail is escaped: every row of the table has the header's six cells."""
    cfg = config_from_dict({"paths": {"reports_dir": str(tmp_path / "reports")}})
    check = Check("left_padded_extraction", "pass", 0.0, "max |logp alone - logp batched|", invariant="I3",
                  bound=1e-4, unit="nats")
    preflight.write_report(cfg, {"passed": True, "checks": [check.as_dict()], "lineage": {}})
    table = [line for line in preflight.report_path(cfg).with_suffix(".md").read_text().splitlines()
             if line.startswith("|")]
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in table]
    assert len(table) == 3 and all(len(row) == 6 for row in cells), table
    assert cells[2][5].strip() == "max \\|logp alone - logp batched\\|"
