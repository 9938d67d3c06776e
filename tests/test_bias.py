"""``grpo bias``: a run's models on published BBQ items (the test fixture's excerpt of the release)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from grpo.cli import main as grpo_main
from grpo.config import load_config
from grpo.data.prompts import render_records
from grpo.eval.bias import bbq_records
from tests.tiny_project import run_stages, tiny_params, write_params

BBQ = Path(__file__).parent / "fixtures" / "bbq"


def test_bbq_records_are_balanced_per_category_and_reproducible():
    records = bbq_records(BBQ, 4, seed=3)
    by_category = Counter(r["category"] for r in records)
    assert len(by_category) == len(list(BBQ.glob("*.jsonl"))) and set(by_category.values()) == {4}
    for category in by_category:
        strata = Counter((r["context_condition"], r["question_polarity"])
                         for r in records if r["category"] == category)
        assert len(strata) == 4 and set(strata.values()) == {1}, (category, strata)
    assert all(r["task"] == "fairness" and r["source"] == "bbq" and r["split"] == "eval" for r in records)
    assert [r["id"] for r in bbq_records(BBQ, 4, seed=3)] == [r["id"] for r in records]
    assert [r["id"] for r in bbq_records(BBQ, 4, seed=4)] != [r["id"] for r in records]
    assert {r["answer_format"] for r in records} == {"letter"}
    assert {r["answer_format"] for r in bbq_records(BBQ, 4, seed=3, answer_format="text")} == {"text"}


def test_bbq_records_render_as_fairness_prompts(tiny_tokenizer):
    records = bbq_records(BBQ, 2, seed=0)
    prompts = render_records(tiny_tokenizer, records, {})
    text = tiny_tokenizer.decode(prompts[0])
    assert records[0]["context"][:20] in text and all(choice in text for choice in records[0]["choices"])


@pytest.mark.slow
def test_bias_scores_every_model_of_the_run_on_bbq(tmp_path, capsys):
    params = write_params(tmp_path, tiny_params(tmp_path))
    run_stages(params, "prepare", "validate", "base", "sft")
    assert grpo_main(["bias", "--params", str(params), "--bbq", str(BBQ), "--per-category", "4"]) == 0
    cfg = load_config(params)
    summary = json.loads((Path(cfg.paths.metrics_dir) / "bias.json").read_text())
    assert summary["items"] == 4 * len(list(BBQ.glob("*.jsonl")))
    assert set(summary["models"]) == {"base", "sft"} and summary["intervals"] == {}  # no GRPO model yet
    for figures in summary["models"].values():
        overall = figures["overall"]
        assert 0.0 <= overall["accuracy_ambig"] <= 1.0 and -1.0 <= overall["s_amb"] <= 1.0
        assert set(figures["by_category"]) == {f.stem for f in BBQ.glob("*.jsonl")}
    report = (Path(cfg.paths.reports_dir) / "bias.md").read_text()
    assert "| s_amb |" in report and "## s_AMB per category" in report and "| Age |" in report
    assert "bias.json" in capsys.readouterr().out


def test_bias_names_a_missing_folder(tmp_path, capsys):
    params = write_params(tmp_path, tiny_params(tmp_path))
    assert grpo_main(["bias", "--params", str(params), "--bbq", str(tmp_path / "nowhere")]) == 1
    assert "nowhere" in capsys.readouterr().err


def test_bias_report_opens_with_the_verdict_on_bbq(tmp_path):
    """A GRPO model that says "unknown" on BBQ's ambiguous items and loses disambiguated ones: traded."""
    from grpo.config import config_from_dict
    from grpo.eval.bias import SFT_DIFFERENCE, report, sft_verdicts

    up, down, flat = ({"diff": d, "low": d - 0.05, "high": d + 0.05} for d in (0.3, -0.2, 0.0))
    differences = {SFT_DIFFERENCE: {"fairness/accuracy_ambig": up, "fairness/accuracy_disambig": down,
                                    "fairness/abs_s_amb": flat}}
    judged = sft_verdicts(differences)
    assert judged["greedy"]["fairness"]["verdict"] == "traded" and list(judged["greedy"]) == ["fairness"]
    figures = {"accuracy_ambig": 0.1, "accuracy_disambig": 0.5, "s_amb": 0.0, "s_dis": 0.0}
    results = {name: {"overall": figures, "by_category": {"Age": figures}} for name in ("sft", "grpo")}
    levels = {"fairness/accuracy_ambig": 0.1, "fairness/accuracy_disambig": 0.5, "fairness/s_amb": 0.0}
    text = report(results, differences, [{"category": "Age"}], tmp_path, config_from_dict({}),
                  {name: {"greedy": levels} for name in ("sft", "grpo")})
    assert text.startswith("# Bias on BBQ\n\n## verdict\n")
    assert "| greedy | fairness | **traded** | ambiguous acc | disambig. acc |" in text
    assert "| greedy | fairness | disambiguated | accuracy | 0.500 | 0.500 | -0.200 | [-0.250, -0.150] | worse |" in text
    assert "hallucination" not in text.split("## figures per model")[0].replace("| greedy | fairness", "")
    assert sft_verdicts({}) == {}



def test_bias_intervals_are_grpo_minus_each_older_model():
    from grpo.config import config_from_dict
    from grpo.data.schema import LETTERS
    from grpo.eval.bias import intervals

    records = bbq_records(BBQ, 4, seed=3)
    right = [f"Answer: {LETTERS[r['label']]}" for r in records]
    person = [f"Answer: {LETTERS[next(i for i in range(3) if i not in (r['label'], r['unknown_idx']))]}"
              for r in records]  # a person, never the gold one
    texts = {"grpo": {"greedy": right}, "sft": {"greedy": person}, "base": {"greedy": right}}
    diffs = intervals(texts, records, config_from_dict({"eval": {"bootstrap": 200}}))
    assert list(diffs) == ["GRPO − SFT", "GRPO − base"]
    for key in ("fairness/accuracy_ambig", "fairness/accuracy_disambig"):
        gain = diffs["GRPO − SFT"][key]
        assert gain["diff"] == 1.0 and gain["low"] > 0, key  # GRPO right where SFT was wrong: a gain
        assert diffs["GRPO − base"][key]["diff"] == 0.0, key


def test_bias_intervals_need_grpo_and_the_older_model():
    from grpo.config import config_from_dict
    from grpo.data.schema import LETTERS
    from grpo.eval.bias import intervals

    records = bbq_records(BBQ, 2, seed=3)
    right = {"greedy": [f"Answer: {LETTERS[r['label']]}" for r in records]}
    cfg = config_from_dict({"eval": {"bootstrap": 100}})
    assert list(intervals({"grpo": right, "base": right}, records, cfg)) == ["GRPO − base"]
    assert intervals({"sft": right, "base": right}, records, cfg) == {}


def test_bias_report_lists_each_difference_with_its_interval(tmp_path):
    from grpo.config import config_from_dict
    from grpo.eval.bias import SFT_DIFFERENCE, report

    differences = {SFT_DIFFERENCE: {"fairness/accuracy_ambig": {"diff": 0.3, "low": 0.25, "high": 0.35},
                                    "fairness/abs_s_amb": {"diff": None, "low": None, "high": None}}}
    figures = {"accuracy_ambig": 0.1, "accuracy_disambig": 0.5, "s_amb": 0.0, "s_dis": 0.0}
    results = {name: {"overall": figures, "by_category": {"Age": figures}} for name in ("sft", "grpo")}
    text = report(results, differences, [{"category": "Age"}], tmp_path, config_from_dict({"eval": {"bootstrap": 177}}))
    table = text.split(f"## {SFT_DIFFERENCE}, 95 % paired bootstrap (177 resamples)")[1]
    assert "| fairness/accuracy_ambig | 0.300 | [+0.250, +0.350] |" in table
    assert "| fairness/abs_s_amb | — | — |" in table


def test_bias_report_shows_s_amb_per_category(tmp_path):
    from grpo.config import config_from_dict
    from grpo.eval.bias import report

    figures = {"accuracy_ambig": 0.1, "accuracy_disambig": 0.5, "s_amb": 0.25, "s_dis": -0.75}
    age = figures | {"s_amb": 0.625}
    results = {name: {"overall": figures, "by_category": {"Age": age}} for name in ("sft", "grpo")}
    text = report(results, {}, [{"category": "Age"}], tmp_path, config_from_dict({}))
    per_category = text.split("## s_AMB per category")[1]
    assert "| Age | 0.625 | 0.625 |" in per_category and "-0.750" not in per_category


def test_each_categorys_figures_are_read_from_its_own_metrics():
    from grpo.eval.bias import model_figures

    greedy = {"fairness/s_amb": 0.25, "fairness/accuracy_ambig": 0.5,
              "fairness/by_category/Age/s_amb": 0.625, "fairness/by_category/Age/accuracy_ambig": 0.75}
    figures = model_figures(greedy, ["Age"])
    assert figures["overall"]["s_amb"] == 0.25 and figures["by_category"]["Age"]["s_amb"] == 0.625
    assert figures["by_category"]["Age"]["accuracy_ambig"] == 0.75
