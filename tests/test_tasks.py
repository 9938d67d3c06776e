"""tasks/: the environment every stage runs in, and how stage files become artifact rows (fast)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.artifacts import _cells, flatten, readable_tables
from tasks.dvc_stage import stage_env


def test_stage_env_is_offline_and_runs_the_project_code(tmp_path, monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    env = stage_env(tmp_path)
    assert (env["DO_NOT_TRACK"], env["DVC_NO_ANALYTICS"], env["PREFECT_SERVER_ANALYTICS_ENABLED"]) == ("1", "1", "false")
    assert env["WANDB_MODE"] == "offline" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["DVC_SITE_CACHE_DIR"].startswith(str(tmp_path))


def test_stage_env_keeps_a_deliberate_online_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert stage_env(tmp_path)["WANDB_MODE"] == "online"


def test_metrics_and_rows_flatten_to_table_cells():
    assert flatten({"sft": {"greedy": {"acc": 0.5}}, "steps": 2}) == {"sft.greedy.acc": 0.5, "steps": 2}
    assert _cells({"name": "I7", "numbers": {"d": 1.0}, "passed": True}) == {
        "name": "I7", "numbers": '{"d": 1.0}', "passed": True}


def test_wide_tables_become_lists_that_wrap_and_narrow_ones_stay():
    wide = "| rule | column | result | detail |\n| --- | --- | --- | --- |\n" + (
        "| balance.ambig.train | ambig_train | pass | observed 0.5, expected between 0.19381378215210276 and "
        "0.8061862178478972 |\n")
    narrow = "| metric | value |\n| --- | --- |\n| loss | 0.5 |\n"
    out = readable_tables(f"# Report\n\n{wide}\nafter\n\n{narrow}")
    assert "- **balance.ambig.train** · column: ambig_train · result: pass · detail: observed 0.5" in out
    assert "| balance.ambig.train" not in out and narrow in out and out.startswith("# Report\n\n")
    assert out.rstrip().endswith("| loss | 0.5 |") and "\nafter\n" in out
