"""Tests of grpo/eval/plots.py: real JSON/JSONL files in tmp_path, real PNGs read back with matplotlib."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from grpo.cli import main
from grpo.config import config_from_dict
from grpo.errors import GrpoError
from grpo.eval.metrics import KEY_ROWS
from grpo.eval.plots import (
    PlotInputError,
    build_entropy_figure,
    build_eval_figure,
    discover_entropy_files,
    entropy_stats,
    load_entropy_history,
    load_metrics_jsonl,
    plot_entropy,
    plot_eval_comparison,
    run,
)

HISTORY_A = [{"step": 1, "entropy": 4.5}, {"step": 2, "entropy": 4.0}, {"step": 3, "entropy": 3.5}]
HISTORY_B = [{"step": 1, "entropy": 2.0}, {"step": 2, "entropy": 1.0}]
METRICS = [
    {"step": 1, "reward": 0.2, "reward_std": 0.1, "frac_reward_zero_std": 0.5, "rewards/fairness/mean": 0.3},
    {"step": 2, "reward": 0.4, "reward_std": 0.2, "frac_reward_zero_std": 0.25},
]


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


def legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


# ---------------------------------------------------------------------------- plotting


def test_two_runs_png_size_and_legend(tmp_path):
    histories = {"A": HISTORY_A, "B": HISTORY_B}
    out = plot_entropy(histories, tmp_path / "sub" / "entropy.png")
    assert out == tmp_path / "sub" / "entropy.png" and out.is_file()
    assert mpimg.imread(out).shape[:2] == (300, 900)  # one 9x3 in panel at 100 dpi
    fig = build_entropy_figure(histories)
    assert legend_texts(fig.axes[0]) == ["A", "B"]


@pytest.mark.parametrize(
    ("with_stats", "metrics", "n_panels"),
    [(False, None, 1), (True, None, 2), (False, METRICS, 3), (True, METRICS, 4)],
)
def test_panels_stack_300px_each(tmp_path, with_stats, metrics, n_panels):
    """| stats | metrics | panels | -> entropy [+ reward + zero-std] [+ stats table], 300 px each."""
    out = plot_entropy({"A": HISTORY_A}, tmp_path / "p.png", with_stats=with_stats, metrics=metrics)
    assert mpimg.imread(out).shape[:2] == (300 * n_panels, 900)
    fig = build_entropy_figure({"A": HISTORY_A}, with_stats=with_stats, metrics=metrics)
    assert len(fig.axes) == n_panels


def test_metrics_panels_show_reward_band_tasks_and_zero_std():
    fig = build_entropy_figure({"A": HISTORY_A}, with_stats=True, metrics=METRICS)
    assert legend_texts(fig.axes[1]) == ["reward", "+- reward_std", "rewards/fairness/mean"]
    assert legend_texts(fig.axes[2]) == ["frac_reward_zero_std"]
    zero_std_line = fig.axes[2].get_lines()[0]
    assert list(zero_std_line.get_ydata()) == [0.5, 0.25]
    table_cells = [cell.get_text().get_text() for cell in fig.axes[3].tables[0].get_celld().values()]
    assert "A" in table_cells and "4.0000" in table_cells  # mean of 4.5, 4.0, 3.5


def test_entropy_stats_hand_history():
    """| 2: 3.0, 1: 4.0, 3: 2.0 | mean 3 | min 2 | max 4 | final (step 3) 2 | steps 3 |"""
    history = [{"step": 2, "entropy": 3.0}, {"step": 1, "entropy": 4.0}, {"step": 3, "entropy": 2.0}]
    assert entropy_stats(history) == {"mean": 3.0, "min": 2.0, "max": 4.0, "final": 2.0, "steps": 3}


# ---------------------------------------------------------------------------- files and discovery


def test_load_sorts_by_step(tmp_path):
    path = write_json(tmp_path / "entropy_history_x.json", list(reversed(HISTORY_A)))
    assert load_entropy_history(path) == HISTORY_A


def test_discovery_labels_from_file_names(tmp_path):
    write_json(tmp_path / "run1" / "entropy_history_cagrad.json", HISTORY_A)
    write_json(tmp_path / "run2" / "deep" / "entropy_history_pcgrad.json", HISTORY_B)
    write_json(tmp_path / "run2" / "other.json", HISTORY_B)  # not an entropy history: ignored
    found = discover_entropy_files(tmp_path)
    assert found == {
        "cagrad": tmp_path / "run1" / "entropy_history_cagrad.json",
        "pcgrad": tmp_path / "run2" / "deep" / "entropy_history_pcgrad.json",
    }


def test_discovery_keeps_same_name_in_two_folders(tmp_path):
    write_json(tmp_path / "a" / "entropy_history_sum.json", HISTORY_A)
    write_json(tmp_path / "b" / "entropy_history_sum.json", HISTORY_B)
    assert sorted(discover_entropy_files(tmp_path)) == ["sum (a)", "sum (b)"]
    write_json(tmp_path / "runs" / "a" / "seed1" / "entropy_history_seed.json", HISTORY_A)
    write_json(tmp_path / "runs" / "b" / "seed1" / "entropy_history_seed.json", HISTORY_B)
    labels = sorted(discover_entropy_files(tmp_path / "runs"))
    assert labels == ["seed (a/seed1)", "seed (b/seed1)"]  # folders that end alike: neither replaces the other


def test_a_cut_last_line_is_skipped_by_the_plot_and_the_trainer_alike(tmp_path):
    """A run killed while writing leaves one cut line at the end: both read the steps before it."""
    from grpo.health.metrics import read_metrics

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in METRICS) + '{"step": 3, "rew', encoding="utf-8")
    assert load_metrics_jsonl(path) == METRICS == read_metrics(path)


def test_load_metrics_skips_blank_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(METRICS[0]) + "\n\n" + json.dumps(METRICS[1]) + "\n", encoding="utf-8")
    assert load_metrics_jsonl(path) == METRICS


# ---------------------------------------------------------------------------- the command


def test_run_with_search_dir_writes_default_path(tmp_path, capsys):
    write_json(tmp_path / "runs" / "entropy_history_alpha.json", HISTORY_A)
    write_json(tmp_path / "runs" / "entropy_history_beta.json", HISTORY_B)
    cfg = config_from_dict(
        {"paths": {"reports_dir": str(tmp_path / "reports"), "runs_dir": str(tmp_path / "runs")}}
    )
    metrics = write_jsonl(tmp_path / "steps.jsonl", METRICS)
    assert run(cfg, with_stats=True, metrics_file=metrics) == 0
    out = tmp_path / "reports" / "entropy.png"
    assert mpimg.imread(out).shape[:2] == (1200, 900)
    printed = capsys.readouterr().out
    assert "alpha: mean=4 min=3.5 max=4.5 final=3.5 steps=3" in printed
    assert "beta: mean=1.5" in printed


def test_cli_entropy_files_with_labels(tmp_path):
    a = write_json(tmp_path / "entropy_history_a.json", HISTORY_A)
    b = write_json(tmp_path / "entropy_history_b.json", HISTORY_B)
    params = tmp_path / "params.yaml"
    params.write_text("seed: 1\n", encoding="utf-8")
    out = tmp_path / "two.png"
    argv = [
        "plot-entropy",
        "--params",
        str(params),
        "--entropy-files",
        str(a),
        str(b),
        "--labels",
        "base",
        "tuned",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert mpimg.imread(out).shape[:2] == (300, 900)


def test_cli_reports_errors_with_exit_code_1(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 1\n", encoding="utf-8")
    missing = tmp_path / "entropy_history_gone.json"
    assert main(["plot-entropy", "--params", str(params), "--entropy-files", str(missing)]) == 1
    assert f"{missing}: no such entropy history file" in capsys.readouterr().err


# ---------------------------------------------------------------------------- errors

BAD_HISTORIES = [
    ("{not json", "not valid JSON"),
    ("[]", "non-empty JSON list"),
    ('{"step": 1, "entropy": 2.0}', "non-empty JSON list"),
    ('[{"step": 1, "entropy": 2.0}, {"step": 2}]', "entry 1"),
    ('[{"step": 1, "entropy": "high"}]', "entry 0"),
    ('[{"step": 1, "entropy": NaN}]', "entry 0"),
]


@pytest.mark.parametrize(("text", "fragment"), BAD_HISTORIES)
def test_malformed_history_names_file_and_problem(tmp_path, text, fragment):
    path = tmp_path / "entropy_history_bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlotInputError, match=fragment) as info:
        load_entropy_history(path)
    assert str(path) in str(info.value) and isinstance(info.value, GrpoError)


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (['{"step": 1, "reward": 0.1}', "oops", '{"step": 2, "reward": 0.1}'], "line 2 is not valid JSON"),
        (['{"reward": 0.1}'], "record 1 needs a JSON object with a numeric 'step'"),
        (['{"step": 1, "loss": 0.1}'], "no line has a numeric 'reward'"),
    ],
)
def test_malformed_metrics_names_file_and_line(tmp_path, lines, fragment):
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PlotInputError, match=fragment) as info:
        load_metrics_jsonl(path)
    assert str(path) in str(info.value)


def test_flag_combinations_are_refused_by_the_cli(tmp_path, capsys):
    a = write_json(tmp_path / "entropy_history_a.json", HISTORY_A)
    b = write_json(tmp_path / "entropy_history_b.json", HISTORY_B)
    params = tmp_path / "params.yaml"
    params.write_text("seed: 1\n", encoding="utf-8")
    cases = [
        (("--entropy-files", str(a), str(b), "--labels", "only-one"), "--labels has 1 label"),
        (("--entropy-files", str(a), "--search-dir", str(tmp_path)), "not both"),
        (("--labels", "x"), "--labels names --entropy-files"),
        (("--entropy-files",), "without any file"),
    ]
    for argv, fragment in cases:
        assert main(["plot-entropy", "--params", str(params), *argv, "--out", str(tmp_path / "x.png")]) == 2
        assert fragment in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_argument_errors(tmp_path):
    a = write_json(tmp_path / "entropy_history_a.json", HISTORY_A)
    cfg = config_from_dict({"paths": {"runs_dir": str(tmp_path / "no_runs")}})
    cases = [
        ({"entropy_files": [a, a], "labels": ["x", "x"]}, "labels must be distinct"),
        ({"entropy_files": [a], "labels": ["x", "y"]}, "2 label"),
        ({}, "no_runs: no such folder"),
        ({"search_dir": tmp_path / "empty"}, "no such folder"),
    ]
    (tmp_path / "nothing").mkdir()
    cases.append(({"search_dir": tmp_path / "nothing"}, "no entropy_history_"))
    for options, fragment in cases:
        with pytest.raises(PlotInputError, match=fragment):
            run(cfg, out=tmp_path / "x.png", **options)
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(PlotInputError, match="nothing to plot"):
        build_entropy_figure({})
    with pytest.raises(PlotInputError, match="history is empty"):
        entropy_stats([])


def test_the_evaluation_bars_are_each_models_greedy_rows(tmp_path, monkeypatch):
    greedy = {key: 0.1 * (k + 1) for k, key in enumerate(KEY_ROWS)}
    results = {"sft": {"greedy": greedy, "sampled": dict.fromkeys(KEY_ROWS, 0.9)},
               "grpo": {"greedy": {KEY_ROWS[0]: 0.5}}}  # rows it lacks are drawn as 0
    (ax,) = build_eval_figure(results).axes
    heights = [round(bar.get_height(), 6) for bar in ax.patches]
    n = len(KEY_ROWS)
    assert heights[:n] == [round(greedy[key], 6) for key in KEY_ROWS]
    assert heights[n:] == [0.5] + [0.0] * (n - 1)
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["sft", "grpo"]
    out = plot_eval_comparison(results, tmp_path / "reports" / "eval.png")
    assert mpimg.imread(out).shape[2] == 4

    from grpo.eval import plots

    written = {}
    monkeypatch.setattr(plots, "write_atomically", written.update)  # a kill mid-write leaves the old PNG whole
    plots.plot_eval_comparison(results, tmp_path / "other" / "eval.png")
    assert list(written) == [tmp_path / "other" / "eval.png"] and not (tmp_path / "other").exists()
