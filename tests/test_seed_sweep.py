"""Tests of grpo/seed_sweep.py: per-seed output folders, the table and the count of seeds improved beyond noise."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.cli import build_parser
from grpo.seed_sweep import COLUMNS, improved, seed_config, seed_row, seeds_report, seeds_table
from tests.eval_project import project_cfg


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
         "over_abstention_grpo": 0.1, "diffs": _diffs(0.3, 0.1, 0.5),
         "verdicts": {"fairness": "improved", "hallucination": "traded"}},
        {"seed": 2, "sft_reward": 0.1, "grpo_reward": 0.2, "abstain_reward": 0.25,
         "over_abstention_grpo": 0.1, "diffs": _diffs(0.1, -0.1, 0.3),
         "verdicts": {"fairness": "traded", "hallucination": "traded"}},
    ]
    table = seeds_table(rows)
    assert table.startswith("Verdicts: fairness: improved 1/2, traded 1/2; hallucination: traded 2/2.\n")
    assert "| 1 | improved | traded | 0.100 | 0.400 | 0.250 | 0.100 | +0.300 [+0.10, +0.50] |" in table
    counts = table.splitlines()[-1].split("|")[8:-1]
    # Upward metrics: seed 1 only; downward metrics (an increase is a regression): none.
    assert [c.strip() for c in counts] == ["1/2" if sign > 0 else "0/2" for sign in COLUMNS.values()]


def test_a_zero_is_a_figure_and_not_a_missing_one():
    """A reward, a rate or a difference of exactly 0 is written as 0 (a common value for rates), not as "—"."""
    row = {"seed": 3, "sft_reward": 0.0, "grpo_reward": 0.25, "abstain_reward": 0.25, "over_abstention_grpo": 0.0,
           "diffs": _diffs(0.0, -0.1, 0.1), "verdicts": {"fairness": "no change"}}
    line = next(line for line in seeds_table([row]).splitlines() if line.startswith("| 3 |"))
    assert "| 0.000 | 0.250 | 0.250 | 0.000 | +0.000 [-0.10, +0.10] |" in line


def _write_seed_run(cfg, sampled: bool) -> None:
    metrics = Path(cfg.paths.metrics_dir)
    metrics.mkdir(parents=True)
    results = {"sft": {"greedy": {"reward": 0.3, "hallucination/over_abstention_rate": 0.05}},
               "grpo": {"greedy": {"reward": 0.5, "hallucination/over_abstention_rate": 0.1}}}
    compare = {"baselines": {"abstain": {"reward": 0.25}},
               "grpo_minus_sft": {"greedy": _diffs(0.2, 0.1, 0.3), "sampled": {}},
               "verdicts": {"greedy": {"fairness": {"verdict": "traded"}, "hallucination": {"verdict": "improved"}}}}
    if sampled:
        results["sft"]["sampled"] = {"reward": 0.1, "hallucination/over_abstention_rate": 0.07}
        results["grpo"]["sampled"] = {"reward": 0.4, "hallucination/over_abstention_rate": 0.2}
        compare["grpo_minus_sft"]["sampled"] = _diffs(0.3, -0.1, 0.6)
    (metrics / "eval.json").write_text(json.dumps(results))
    (metrics / "eval_compare.json").write_text(json.dumps(compare))


def test_seed_row_reads_the_seed_run_outputs_of_each_decoding(tmp_path):
    cfg = seed_config(project_cfg(tmp_path), 7)
    _write_seed_run(cfg, sampled=True)
    greedy, sampled = seed_row(cfg, "greedy"), seed_row(cfg, "sampled")
    assert greedy["seed"] == 7 and greedy["abstain_reward"] == 0.25
    assert (greedy["sft_reward"], greedy["grpo_reward"], greedy["over_abstention_grpo"]) == (0.3, 0.5, 0.1)
    assert (sampled["sft_reward"], sampled["grpo_reward"], sampled["over_abstention_grpo"]) == (0.1, 0.4, 0.2)
    assert sampled["diffs"]["reward"] == {"diff": 0.3, "low": -0.1, "high": 0.6}


def test_seeds_report_has_a_sampled_table_only_where_every_seed_sampled(tmp_path):
    cfg = project_cfg(tmp_path)
    both, greedy_only = seed_config(cfg, 1), seed_config(cfg, 2)
    _write_seed_run(both, sampled=True)
    _write_seed_run(greedy_only, sampled=False)
    assert seed_row(greedy_only, "sampled") is None
    rows = [{mode: seed_row(c, mode) for mode in ("greedy", "sampled")} for c in (both, greedy_only)]
    report = seeds_report(rows, cfg)
    assert "## Greedy replies" in report and "## Sampled" not in report
    report = seeds_report(rows[:1], cfg)
    greedy, sampled = report.split("## Sampled replies")
    assert "| 1 | traded | improved | 0.300 | 0.500 | 0.250 | 0.100 | +0.200 [+0.10, +0.30] |" in greedy
    assert "Verdicts: fairness: traded 1/1; hallucination: improved 1/1." in greedy
    assert f"({cfg.eval.samples_per_prompt} per prompt at temperature" in sampled
    assert "| 1 | — | — | 0.100 | 0.400 | 0.250 | 0.200 | +0.300 [-0.10, +0.60] |" in sampled
    assert sampled.splitlines()[-1].startswith("| improved beyond noise | | | | | | | 0/1 |")


def test_seeds_command_takes_a_list_of_seeds():
    args = build_parser().parse_args(["seeds", "--seeds", "4", "5", "6"])
    assert args.seeds == [4, 5, 6]
    assert build_parser().parse_args(["seeds"]).seeds == [1, 2, 3]


def test_each_seeds_row_holds_that_seeds_own_run(tmp_path, monkeypatch):
    from grpo import seed_sweep

    cfg = project_cfg(tmp_path)

    def pipeline(seeded):  # the seed's run: its GRPO reward is a tenth of its seed
        _write_seed_run(seeded, sampled=False)
        path = Path(seeded.paths.metrics_dir) / "eval.json"
        results = json.loads(path.read_text())
        results["grpo"]["greedy"]["reward"] = seeded.seed / 10
        path.write_text(json.dumps(results))
        return 0

    monkeypatch.setattr(seed_sweep.pipeline, "run", pipeline)
    assert seed_sweep.run(cfg, seeds=(1, 2)) == 0
    report = (Path(cfg.paths.reports_dir) / "seeds.md").read_text()
    assert "| 1 | traded | improved | 0.300 | 0.100 |" in report and "| 2 | traded | improved | 0.300 | 0.200 |" in report
