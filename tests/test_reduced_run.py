"""End-to-end on a reduced run: a known GRPO bug is caught before any step is taken.

The bug is the one DESIGN.md I7 names: the entropy term's sign flipped in the gradient path of the
configured multitask mode (``grpo.core.multitask``'s use of ``total_loss``). On a prepared project
(tiny model, data, SFT, a passing pre-flight), the pre-flight gate runs the configured mode's entropy
step, fails ``entropy_sign`` and ``grpo train`` refuses to start, so no run with the bug can end up
with a model; the same project without the bug passes again.
"""

from __future__ import annotations

import json

import pytest

from grpo.checks.preflight import report_path
from grpo.cli import main as grpo_main
from grpo.config import load_config
from grpo.core import multitask
from grpo.core.losses import LossTerms
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow


def _entropy_sign_flipped(terms: LossTerms, beta: float, entropy_coef: float):
    return terms.policy + beta * terms.kl + entropy_coef * terms.entropy


def test_entropy_sign_flipped_in_the_configured_mode_is_caught_before_training(tmp_path, monkeypatch, capsys):
    params = prepared_project(tmp_path / "p")  # a passing pre-flight, as made
    cfg = load_config(params)
    monkeypatch.setattr(multitask, "total_loss", _entropy_sign_flipped)
    assert grpo_main(["preflight", "--params", str(params)]) == 1
    report = json.loads(report_path(cfg).read_text())
    assert [check["name"] for check in report["checks"] if not check["passed"]] == ["entropy_sign"]
    capsys.readouterr()
    assert grpo_main(["train", "--params", str(params)]) == 1
    assert "pre-flight failed (entropy_sign)" in capsys.readouterr().err
    assert not (tmp_path / "p" / "models" / "grpo").exists()
    monkeypatch.undo()  # the same project without the bug passes again
    assert grpo_main(["preflight", "--params", str(params)]) == 0
