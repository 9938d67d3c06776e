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


def test_the_setup_counts_the_eval_samples_and_the_verdict_names_a_skipped_sft(tmp_path):
    """The sampled metrics' replies per item are ``eval.samples_per_prompt`` (not the training group); with
    SFT not evaluated the verdict says which model is missing and why, not merely that nothing was compared."""
    cfg = project_cfg(Path(tmp_path), eval={"samples_per_prompt": 3}, grpo={"group_size": 2})
    results = {name: {"greedy": {"m": 0.5}, "sampled": {"m": 0.5}} for name in ("base", "grpo")}
    text = markdown_report(results, {"sft": "models/sft is absent"}, 8, cfg)
    assert "greedy decoding, and 3 samples per prompt at temperature" in text
    assert "No verdict: SFT skipped (models/sft is absent)." in text


def test_the_headline_and_the_intervals_follow_the_setup_when_compared(tmp_path):
    from grpo.eval.compare import INTERVAL_METRICS

    cfg = project_cfg(Path(tmp_path), eval={"samples_per_prompt": 0})
    results = {name: {"greedy": {"m": 0.5}} for name in ("base", "sft", "grpo")}
    without = markdown_report(results, {}, 8, cfg, {"baselines": {}, "grpo_minus_sft": None})
    assert without.index("## setup") < without.index("## headline") and "bootstrap intervals" not in without
    row = {"diff": 0.0, "low": -0.1, "high": 0.1}
    intervals = {"greedy": {key: row for key in INTERVAL_METRICS}}
    text = markdown_report(results, {}, 8, cfg, {"baselines": {}, "grpo_minus_sft": intervals})
    assert text.index("## headline") < text.index("## GRPO − SFT, 95 % bootstrap intervals") < text.index("## greedy")
    assert "[-0.100, +0.100]" in text


def test_a_delta_of_an_integer_and_a_float_is_a_float(tmp_path):
    results = {"sft": {"greedy": {"n": 3}}, "grpo": {"greedy": {"n": 3.5}}}
    assert "| n | — | 3 | 3.500 | +0.500 | — |" in markdown_report(results, {}, 8, project_cfg(tmp_path))
