"""Tests of grpo/eval/report.py: eval.md's setup, its tables per decoding mode and their deltas."""

from __future__ import annotations

from pathlib import Path

from grpo.eval.report import markdown_report
from tests.eval_project import project_cfg


def test_markdown_report_columns_deltas_and_skip_note(tmp_path):
    results = {"base": {"greedy": {"m": 0.25}, "sampled": {}}, "sft": {"greedy": {"m": 0.5}, "sampled": {}}}
    text = markdown_report(results, {"grpo": "models/grpo is absent"}, 6, project_cfg(tmp_path))
    assert "| metric | base | SFT | GRPO | GRPO − SFT | SFT − base |" in text
    assert "| m | 0.250 | 0.500 | — | — | +0.250 |" in text
    assert "- GRPO skipped: models/grpo is absent" in text


def test_setup_then_one_table_per_decoded_mode_with_integer_deltas(tmp_path):
    """Greedy only: the setup says so, and only the greedy table follows it; counts keep integer deltas."""
    cfg = project_cfg(Path(tmp_path), eval={"samples_per_prompt": 0})
    results = {name: {"greedy": {"n": n, "rate": n / 8}} for name, n in (("base", 2), ("sft", 3), ("grpo", 7))}
    text = markdown_report(results, {}, 8, cfg)
    assert "8 eval records from" in text and "greedy decoding only (`eval.samples_per_prompt: 0`)" in text
    assert text.index("## setup") < text.index("## greedy") and "## sampled" not in text
    assert "| n | 2 | 3 | 7 | +4 | +1 |" in text
    assert "| rate | 0.250 | 0.375 | 0.875 | +0.500 | +0.125 |" in text
