"""grpo/provenance/status.py without DVC (``tests/test_dvc_pipeline.py`` runs ``grpo status`` on a real
pipeline): which modules a stage's last run and its code now differ in, and the lines the user reads."""

from __future__ import annotations

import json

import pytest
import yaml

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


def test_the_recorded_fingerprint_is_the_md5_of_each_stages_fingerprint_dependency(tmp_path):
    from grpo.provenance.status import recorded_md5

    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "sft": {"cmd": "grpo sft", "deps": [{"path": "data/processed/train.jsonl", "md5": "d1"},
                                            {"path": f"{FINGERPRINT_DIR.as_posix()}/sft.json", "md5": "f1"}]},
        "fingerprint": {"cmd": "grpo fingerprint", "md5": "not-a-dependency"},
    }}))
    assert recorded_md5(tmp_path) == {"sft": "f1"}
    assert recorded_md5(tmp_path / "nowhere") == {}


def test_status_lists_pipeline_stages_only_and_fails_when_dvc_does(tmp_path, monkeypatch):
    """DVC always reports its ``fingerprint`` stage changed: that is no stale stage of the pipeline; a ``dvc
    status`` that cannot run is an error naming the folder, never "up to date"."""
    from grpo.config import config_from_dict
    from grpo.provenance import status as status_module

    monkeypatch.setattr(status_module, "write_fingerprints", lambda cfg, folder: None)
    monkeypatch.setattr(status_module, "dvc_status", lambda project: {
        "fingerprint": ["always changed"], "sft": [{"changed deps": {"data/processed/train.jsonl": "modified"}}]})
    assert status_module.status(tmp_path, config_from_dict({})) == {"sft": ["deps: data/processed/train.jsonl modified"]}
    monkeypatch.undo()
    with pytest.raises(status_module.StatusError, match=rf"`dvc status --json` failed in {tmp_path}"):
        status_module.dvc_status(tmp_path)  # no DVC project here
