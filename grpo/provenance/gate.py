"""The pre-flight gate: GRPO starts only after a passing pre-flight for the current lineage.

``grpo preflight`` writes ``<reports_dir>/preflight.json`` with the code fingerprint, params hash and
input hashes it ran under (``LINEAGE_KEYS`` of its lineage); the trainer calls ``require_preflight``
before anything else. It lives with the lineage it compares, below the trainer, so the trainer does
not import the checks.
"""

from __future__ import annotations

import json
from typing import Any

from grpo import paths
from grpo.config import Config
from grpo.errors import GrpoError
from grpo.provenance.lineage import make_lineage

LINEAGE_KEYS = ("code_fingerprint", "params_hash", "inputs")
REPORT_NAME = "preflight.json"


class PreflightError(GrpoError):
    """The pre-flight checks failed or are missing for the current code, params and model."""


def preflight_lineage(cfg: Config) -> dict[str, Any]:
    """What a pre-flight report records of its lineage: the keys that must match at train time."""
    lineage = make_lineage("preflight", cfg, paths.stage_inputs(cfg, "preflight"))
    return {key: lineage[key] for key in LINEAGE_KEYS}


def require_preflight(cfg: Config) -> None:
    """Refuse to train without a passing pre-flight for the current code, params and SFT model."""
    path = paths.report_file(cfg, REPORT_NAME)
    how = "run `grpo preflight` (or `dvc repro preflight`) first"
    if not path.is_file():
        raise PreflightError(f"{path} does not exist: GRPO needs a passing pre-flight; {how}")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        report, why = None, f"{exc}; cut short by a killed run?"
    else:
        why = "not a JSON object"
    if not isinstance(report, dict):
        raise PreflightError(f"{path} is not a pre-flight report ({why}); {how}")
    failed = [c.get("name", "?") for c in report.get("checks", []) if not c.get("passed")]
    if not report.get("passed") or failed:
        raise PreflightError(f"{path}: pre-flight failed ({', '.join(failed)}); fix them, then {how}")
    current = preflight_lineage(cfg)
    changed = [key for key in LINEAGE_KEYS if report.get("lineage", {}).get(key) != current[key]]
    if changed:
        raise PreflightError(f"{path} was made for other {', '.join(changed)} than the current ones; {how}")
