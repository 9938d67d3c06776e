"""benchmarks/grpo_step.py: the benchmark's smoke mode (one step of each project variant) runs and
writes its results; TRL is skipped cleanly where it is not installed. Not a timed test."""

from __future__ import annotations

import json

import pytest

from benchmarks.grpo_step import main as bench_main
from tests.tiny_project import prepared_project


@pytest.mark.slow
def test_benchmark_smoke_mode_writes_results(tmp_path):
    project = prepared_project(tmp_path / "project").parent
    out = tmp_path / "results.json"
    assert bench_main(["--smoke", "--project", str(project), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["variants"]) == {"project-sum", "project-cagrad"}
    for stats in results["variants"].values():
        assert stats["steps"] == 1 and stats["step_s"] > 0 and stats["peak_rss_mb"] > 0
        assert set(stats["phases_s"]) == {"generate", "reward", "reference", "update"}
    assert results["speedup_vs_trl"] == {} and results["trl_reference"] is None
    assert results["cagrad_over_sum"] > 0
