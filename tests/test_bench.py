"""benchmarks/grpo_step.py: the benchmark's smoke mode (one step of each project variant) runs and
writes its results; TRL is skipped cleanly where it is not installed. Not a timed test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks.grpo_step import main as bench_main
from tests.tiny_project import prepared_project

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_smoke_mode_writes_results(tmp_path):
    project = prepared_project(tmp_path / "project").parent
    out = tmp_path / "results.json"
    assert bench_main(["--smoke", "--project", str(project), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["variants"]) == {"project-sum", "project-cagrad", "project-sum-off"}
    for stats in results["variants"].values():
        assert stats["steps"] == 1 and stats["step_s"] > 0 and stats["peak_rss_mb"] > 0
        assert set(stats["phases_s"]) == {"generate", "reward", "reference", "update"}
    assert results["speedup_vs_trl"] == {} and results["trl_reference"] is None
    assert results["cagrad_over_sum"] > 0
    assert all(stats["decode_ms_per_step"] > 0 for stats in results["variants"].values())


@pytest.mark.slow
def test_benchmark_on_a_profile_prepares_its_model_and_reports_decode_and_profile(tmp_path):
    """``--params PROFILE``: the project is built from the profile (its model and settings over params.yaml),
    the results name the model and give ms per decode step, ``--profile`` adds the operator table."""
    profile = tmp_path / "small.yaml"
    profile.write_text(yaml.safe_dump({
        "extends": str(ROOT / "params.yaml"), "experiment": "small",
        "model": {"tiny": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}},
        "pretrain": {"records": 0}, "sft": {"epochs": 1}}))
    out = tmp_path / "results.json"
    assert bench_main(["--smoke", "--params", str(profile), "--project", str(tmp_path / "p"), "--n-train", "16",
                       "--profile", "--out", str(out)]) == 0
    params = yaml.safe_load((tmp_path / "p" / "params.yaml").read_text())
    assert params["extends"] == str(profile) and params["data"] == {"n_train": 16}
    results = json.loads(out.read_text())
    assert results["model"] == "the embedded tiny model"
    for stats in results["variants"].values():
        assert stats["decode_ms_per_step"] > 0 and stats["decode_rows"] == 32
        assert "Self CPU" in stats["profile"] and "aten::" in stats["profile"]


def test_variants_runs_only_the_named_ones_and_refuses_one_not_in_the_run():
    """``--variants``: the run keeps its order and only the named variants; a name the run would not have
    (misspelt, or TRL's where TRL is not installed) stops it with the names it has."""
    from argparse import Namespace

    from benchmarks.grpo_step import variants

    args = Namespace(smoke=True, no_plain=False, with_trl=False, variants=["project-sum-off", "project-sum"])
    assert variants(args) == ["project-sum", "project-sum-off"]
    with pytest.raises(SystemExit, match="project-summ: not among this run's"):
        variants(Namespace(smoke=True, no_plain=False, with_trl=False, variants=["project-summ"]))
    assert len(variants(Namespace(smoke=True, no_plain=False, with_trl=False, variants=None))) == 3
