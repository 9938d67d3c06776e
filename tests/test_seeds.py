"""Tests of grpo/seeds.py: per-seed output folders, the table and the count of seeds improved beyond noise."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.cli import build_parser
from grpo.seeds import COLUMNS, improved, seed_config, seed_row, seeds_table
from tests.test_evaluate import project_cfg


def _diffs(diff: float, low: float, high: float) -> dict:
    return {key: {"diff": diff, "low": low, "high": high} for key in COLUMNS}


def test_seed_config_puts_every_output_under_its_own_folder(tmp_path):
    cfg = project_cfg(tmp_path)
    one, two = seed_config(cfg, 1), seed_config(cfg, 2)
    assert (one.seed, two.seed) == (1, 2)
    for name in ("data_dir", "models_dir", "metrics_dir", "reports_dir", "runs_dir"):
        a, b = Path(getattr(one.paths, name)), Path(getattr(two.paths, name))
        assert a.parent == tmp_path / "runs" / "seeds" / "seed-1" and b.parent.name == "seed-2"
        assert a.name == Path(getattr(cfg.paths, name)).name
    assert cfg.paths.data_dir == str(tmp_path / "data")  # the input config is unchanged


def test_improved_needs_the_wanted_sign_and_an_interval_off_zero():
    assert improved({"diff": 0.2, "low": 0.05, "high": 0.3}, +1)
    assert not improved({"diff": 0.2, "low": -0.05, "high": 0.3}, +1)
    assert improved({"diff": -0.2, "low": -0.3, "high": -0.01}, -1)
    assert not improved({"diff": 0.2, "low": 0.05, "high": 0.3}, -1)
    assert not improved({"diff": None, "low": None, "high": None}, +1)


def test_seeds_table_counts_seeds_improved_beyond_noise(tmp_path):
    rows = [
        {"seed": 1, "sft_reward": 0.1, "grpo_reward": 0.4, "abstain_reward": 0.25,
         "over_abstention_grpo": 0.1, "diffs": _diffs(0.3, 0.1, 0.5)},
        {"seed": 2, "sft_reward": 0.1, "grpo_reward": 0.2, "abstain_reward": 0.25,
         "over_abstention_grpo": 0.1, "diffs": _diffs(0.1, -0.1, 0.3)},
    ]
    table = seeds_table(rows)
    assert "| 1 | 0.100 | 0.400 | 0.250 | 0.100 | +0.300 [+0.10, +0.50] |" in table
    counts = table.splitlines()[-1].split("|")[6:-1]
    # Upward metrics: seed 1 only; downward metrics (an increase is a regression): none.
    assert [c.strip() for c in counts] == ["1/2" if sign > 0 else "0/2" for sign in COLUMNS.values()]


def test_seed_row_reads_the_seed_run_outputs(tmp_path):
    cfg = seed_config(project_cfg(tmp_path), 7)
    metrics = Path(cfg.paths.metrics_dir)
    metrics.mkdir(parents=True)
    greedy = {"reward": 0.5, "hallucination/over_abstention_rate": 0.1}
    (metrics / "eval.json").write_text(json.dumps({m: {"greedy": greedy} for m in ("sft", "grpo")}))
    compare = {"baselines": {"abstain": {"reward": 0.25}}, "grpo_minus_sft": {"greedy": _diffs(0.0, 0.0, 0.0)}}
    (metrics / "eval_compare.json").write_text(json.dumps(compare))
    row = seed_row(cfg)
    assert row["seed"] == 7 and row["abstain_reward"] == 0.25 and row["grpo_reward"] == 0.5


def test_seeds_command_takes_a_list_of_seeds():
    args = build_parser().parse_args(["seeds", "--seeds", "4", "5", "6"])
    assert args.seeds == [4, 5, 6]
    assert build_parser().parse_args(["seeds"]).seeds == [1, 2, 3]
