"""grpo/provenance/status.py without DVC (``tests/test_dvc_pipeline.py`` runs ``grpo status`` on a real
pipeline): which modules a stage's last run and its code now differ in, and the lines the user reads."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo.provenance.fingerprint import FINGERPRINT_DIR, HISTORY_DIR
from grpo.provenance.status import changed_modules, changed_raw_data, report


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


def test_status_refreshes_the_fingerprints_before_asking_dvc(tmp_path, monkeypatch):
    """A code edit is invisible to ``dvc status`` until fingerprints/<stage>.json is rewritten: what DVC is
    asked about must be the fingerprint of the code as it is now."""
    from grpo.config import config_from_dict
    from grpo.provenance import status as status_module
    from grpo.provenance.fingerprint import stage_fingerprint

    seen = {}

    def dvc_sees(project):
        seen["sft"] = json.loads((project / FINGERPRINT_DIR / "sft.json").read_text())
        return {}

    (tmp_path / FINGERPRINT_DIR).mkdir()
    (tmp_path / FINGERPRINT_DIR / "sft.json").write_text(json.dumps({"stage": "sft", "modules": {}}))
    monkeypatch.setattr(status_module, "dvc_status", dvc_sees)
    assert status_module.status(tmp_path, config_from_dict({})) == {}
    assert seen["sft"] == stage_fingerprint("sft")


def test_a_raw_data_change_is_named_as_such_not_as_an_unknown_code_change(tmp_path, monkeypatch):
    """prepare's fingerprint also holds the published dataset files it reads: when only one of them changed,
    no module did, and ``grpo status`` names the file (edited, added, removed), not a code change."""
    from grpo.config import config_from_dict
    from grpo.provenance import status as status_module

    history = tmp_path / FINGERPRINT_DIR / HISTORY_DIR
    history.mkdir(parents=True)
    modules = {"grpo/data/prepare.py": "1"}
    raw_then = {"data.fairness_path": {"bbq/Age.jsonl": "a", "bbq/Race.jsonl": "r"}}
    raw_now = {"data.fairness_path": {"bbq/Age.jsonl": "a2", "bbq/SES.jsonl": "s"}}
    (history / "m1.json").write_text(json.dumps({"modules": modules, "raw_data": raw_then}))
    (tmp_path / FINGERPRINT_DIR / "prepare.json").write_text(json.dumps({"modules": modules, "raw_data": raw_now}))
    assert changed_modules(tmp_path, "prepare", "m1") == []
    assert changed_raw_data(tmp_path, "prepare", "m1") == [
        "raw data edited: bbq/Age.jsonl (data.fairness_path)",
        "raw data removed: bbq/Race.jsonl (data.fairness_path)",
        "raw data added: bbq/SES.jsonl (data.fairness_path)",
    ]
    assert changed_raw_data(tmp_path, "prepare", None) is None
    monkeypatch.setattr(status_module, "write_fingerprints", lambda cfg, folder: None)
    monkeypatch.setattr(status_module, "recorded_md5", lambda project: {"prepare": "m1"})
    monkeypatch.setattr(status_module, "dvc_status", lambda project: {
        "prepare": [{"changed deps": {f"{FINGERPRINT_DIR.as_posix()}/prepare.json": "modified"}}]})
    reasons = status_module.status(tmp_path, config_from_dict({}))["prepare"]
    assert reasons == changed_raw_data(tmp_path, "prepare", "m1")  # no "code changed (module list unknown ...)"
    monkeypatch.setattr(status_module, "recorded_md5", lambda project: {})
    assert status_module.status(tmp_path, config_from_dict({}))["prepare"] == [
        "code changed (module list unknown: the last run predates it)"]


def test_dvc_status_reads_a_real_projects_changes_and_the_lines_name_each(tmp_path):
    """``dvc status --json`` of a real DVC project (one stage run, then its input file and its param
    edited): its entries as DVC writes them, and a line for each, a param by its key."""
    import subprocess
    import sys

    from grpo.provenance import status as status_module

    def dvc(*args):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=tmp_path, check=True, capture_output=True)

    dvc("init", "--no-scm", "-q")
    (tmp_path / "in.txt").write_text("a\n")
    (tmp_path / "params.yaml").write_text("p:\n  x: 1\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  copy:\n    cmd: cp in.txt out.txt\n    deps: [in.txt]\n    outs: [out.txt]\n    params: [p.x]\n")
    dvc("repro", "-q")
    assert status_module.dvc_status(tmp_path) == {}
    (tmp_path / "in.txt").write_text("b\n")
    (tmp_path / "params.yaml").write_text("p:\n  x: 2\n")
    found = status_module.dvc_status(tmp_path)
    assert found == {"copy": [{"changed deps": {"in.txt": "modified", "params.yaml": {"p.x": "modified"}}}]}
    assert status_module._reasons(["always changed", *found["copy"]], ["code changed (grpo/a.py)"]) == [
        "always changed", "deps: in.txt modified", "params.yaml: p.x modified"]
    fingerprint = [{"changed deps": {f"{FINGERPRINT_DIR.as_posix()}/copy.json": "modified"}}]
    assert status_module._reasons(fingerprint, ["code changed (grpo/a.py)"]) == ["code changed (grpo/a.py)"]


def test_a_failed_dvc_status_says_dvcs_own_words_and_grpo_status_exits_0_when_it_reports(
    tmp_path, monkeypatch, capsys
):
    """Outside a DVC project DVC's own error reaches the user as text; ``grpo status`` that reports (stale
    stages or none) exits 0."""
    from grpo.config import config_from_dict
    from grpo.provenance import status as status_module

    with pytest.raises(status_module.StatusError, match=r"\(exit \d+\): ERROR: you are not inside of a DVC repo"):
        status_module.dvc_status(tmp_path)
    monkeypatch.setattr(status_module, "status", lambda project, cfg: {"sft": ["deps: data/x modified"]})
    assert status_module.run(config_from_dict({})) == 0
    assert capsys.readouterr().out.startswith("grpo status: 1 stage(s) stale")
