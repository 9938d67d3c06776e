"""grpo/provenance/status.py without DVC (``tests/test_dvc_pipeline.py`` runs ``grpo status`` on a real
pipeline): which modules a stage's last run and its code now differ in, and the lines the user reads."""

from __future__ import annotations

import json

from grpo.provenance.fingerprint import FINGERPRINT_DIR, HISTORY_DIR
from grpo.provenance.status import changed_modules, report


def test_changed_modules_name_edited_new_and_dropped_modules(tmp_path):
    history = tmp_path / FINGERPRINT_DIR / HISTORY_DIR
    history.mkdir(parents=True)
    (history / "abc.json").write_text(json.dumps({"modules": {"grpo/a.py": "1", "grpo/b.py": "2", "grpo/old.py": "4"}}))
    now = {"grpo/a.py": "1", "grpo/b.py": "20", "grpo/new.py": "3"}
    (tmp_path / FINGERPRINT_DIR / "grpo.json").write_text(json.dumps({"modules": now}))
    assert changed_modules(tmp_path, "grpo", "abc") == ["grpo/b.py", "grpo/new.py", "grpo/old.py"]
    assert changed_modules(tmp_path, "grpo", "unknown") is None  # the last run predates the history
    assert changed_modules(tmp_path, "grpo", None) is None


def test_the_report_names_each_stale_stage_its_reasons_and_the_rest():
    text = report({"grpo": ["code changed (grpo/b.py)"], "evaluate": ["params: eval.bootstrap modified"]})
    assert text.splitlines()[:5] == [
        "grpo status: 2 stage(s) stale; `dvc repro` reruns them",
        "grpo:", "  code changed (grpo/b.py)", "evaluate:", "  params: eval.bootstrap modified"]
    assert text.splitlines()[-1] == "up to date: prepare, validate, base, sft, preflight"
    assert report({}) == "grpo status: every stage is up to date (code, params, data)"
