"""grpo/provenance/gate.py: ``grpo train`` starts only on a passing pre-flight report made for the current code,
params and inputs, each compared (the lineage is stubbed here; ``tests/test_preflight.py`` makes real ones)."""

from __future__ import annotations

import json

import pytest

from grpo.config import config_from_dict
from grpo.provenance import gate
from grpo.provenance.gate import PreflightError, require_preflight

CURRENT = {"code_fingerprint": "c0de", "params_hash": "9a7a", "inputs": {"sft": "5f7", "data": "da7a"}}


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "preflight_lineage", lambda cfg: json.loads(json.dumps(CURRENT)))
    return config_from_dict({"paths": {"reports_dir": str(tmp_path / "reports")}})


def _report(cfg, **lineage):
    path = gate.paths.report_file(cfg, gate.REPORT_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    checks = [{"name": "render_parity", "passed": True}]
    path.write_text(json.dumps({"passed": True, "checks": checks, "lineage": {**CURRENT, **lineage}}))
    return path


@pytest.mark.parametrize(
    ("changed", "named"),
    [({"code_fingerprint": "01d"}, "code_fingerprint"),  # the step's code changed since the checks ran
     ({"params_hash": "0ther"}, "params_hash"),
     ({"inputs": {"sft": "retrained", "data": "da7a"}}, "inputs")],  # SFT trained again: other weights
)
def test_a_report_made_for_other_code_params_or_inputs_is_refused(cfg, changed, named):
    _report(cfg)
    require_preflight(cfg)
    _report(cfg, **changed)
    with pytest.raises(PreflightError, match=rf"was made for other {named} than the current ones"):
        require_preflight(cfg)


def test_a_report_without_its_lineage_is_refused(cfg):
    path = _report(cfg)
    path.write_text(json.dumps({"passed": True, "checks": []}))  # hand-written, or from older code
    with pytest.raises(PreflightError, match="code_fingerprint, params_hash, inputs than the current ones"):
        require_preflight(cfg)
