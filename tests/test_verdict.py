"""grpo/eval/verdict.py: the verdict of each task from hand-made interval sets, and the report sections."""

from __future__ import annotations

import pytest

from grpo.eval.compare import INTERVAL_METRICS
from grpo.eval.verdict import (
    ROWS,
    WANTED,
    beyond_noise,
    kinds_markdown,
    task_verdict,
    verdict_markdown,
    verdicts,
)

UP = {"diff": 0.20, "low": 0.10, "high": 0.30}  # a rise beyond noise
DOWN = {"diff": -0.20, "low": -0.30, "high": -0.10}  # a fall beyond noise
FLAT = {"diff": 0.02, "low": -0.05, "high": 0.09}  # within noise
UNMEASURED = {"diff": None, "low": None, "high": None}


def better(metric: str) -> dict:
    return UP if WANTED[metric] > 0 else DOWN


def worse(metric: str) -> dict:
    return DOWN if WANTED[metric] > 0 else UP


def intervals(**moved: dict) -> dict:
    """Every interval metric within noise, but those named (``/`` written ``__``)."""
    return {key: moved.get(key.replace("/", "__"), FLAT) for key in INTERVAL_METRICS}


AMB, DIS, SAMB = "fairness/accuracy_ambig", "fairness/accuracy_disambig", "fairness/abs_s_amb"
HRATE, EM, OVER = "hallucination/hallucination_rate", "hallucination/exact_match", "hallucination/over_abstention_rate"
ANS, UNANS = "hallucination/accuracy_answerable", "hallucination/accuracy_unanswerable"


def named(**moved: str) -> dict:
    """``intervals`` with each named metric moved ``better`` or ``worse``."""
    return intervals(**{k: (better if way == "better" else worse)(k.replace("__", "/")) for k, way in moved.items()})


# (task, metrics moved, verdict, better, worse) — the table of the module docstring, on hand-made sets.
CASES = [
    ("fairness", {}, "no change", [], []),
    ("fairness", {"fairness__accuracy_ambig": "better"}, "improved", [AMB], []),
    ("fairness", {"fairness__abs_s_amb": "better"}, "improved", [SAMB], []),  # |s_AMB| falling is better
    ("fairness", {"fairness__accuracy_ambig": "better", "fairness__accuracy_disambig": "worse"}, "traded", [AMB], [DIS]),
    ("fairness", {"fairness__accuracy_disambig": "worse"}, "worse", [], [DIS]),
    ("fairness", {"fairness__abs_s_amb": "worse"}, "worse", [], [SAMB]),
    # The SmolLM2 run: hallucination rate down, unanswerable up, exact match down: a trade.
    (
        "hallucination",
        {"hallucination__hallucination_rate": "better", "hallucination__accuracy_unanswerable": "better",
         "hallucination__exact_match": "worse"},
        "traded",
        [UNANS, HRATE],
        [EM],
    ),
    ("hallucination", {"hallucination__over_abstention_rate": "worse"}, "worse", [], [OVER]),
    ("hallucination", {"hallucination__accuracy_answerable": "better"}, "improved", [ANS], []),
    # The other task's moves never enter a task's verdict.
    ("hallucination", {"fairness__accuracy_disambig": "worse"}, "no change", [], []),
]


DIRECTIONS = {  # written out, not read from ROWS: which way each measured metric is better
    "fairness/accuracy_ambig": 1, "fairness/accuracy_disambig": 1, "fairness/abs_s_amb": -1,
    "hallucination/accuracy_answerable": 1, "hallucination/accuracy_unanswerable": 1,
    "hallucination/exact_match": 1, "hallucination/f1": 1,
    "hallucination/over_abstention_rate": -1, "hallucination/hallucination_rate": -1,
}


def test_each_metric_is_better_in_its_own_direction():
    """A verdict is only as right as the direction it reads each metric in: a falling hallucination rate,
    over-abstention or |s_AMB| is better, a falling accuracy or exact match is worse. (The cases above
    build their moves from ``WANTED`` itself, so this table states the directions independently.)"""
    assert WANTED == DIRECTIONS
    assert task_verdict("hallucination", intervals(hallucination__hallucination_rate=UP)).verdict == "worse"
    assert task_verdict("hallucination", intervals(hallucination__hallucination_rate=DOWN)).verdict == "improved"
    assert task_verdict("fairness", intervals(fairness__accuracy_disambig=DOWN)).verdict == "worse"


@pytest.mark.parametrize(("task", "moved", "verdict", "up", "down"), CASES)
def test_verdict_of_hand_made_interval_sets(task, moved, verdict, up, down):
    found = task_verdict(task, named(**moved))
    assert (found.verdict, found.better, found.worse) == (verdict, up, down)
    assert found.summary.startswith(f"{task} {verdict}: ")


def test_summary_names_both_sides_of_a_trade_with_their_numbers():
    found = task_verdict("fairness", named(fairness__accuracy_ambig="better", fairness__accuracy_disambig="worse"))
    assert found.summary == (
        "fairness traded: better ambiguous acc +0.200 [+0.100, +0.300]; worse disambig. acc -0.200 [-0.300, -0.100]"
    )
    assert task_verdict("fairness", intervals()).summary == "fairness no change: no metric moved beyond noise"


def test_an_interval_touching_zero_or_unmeasured_is_within_noise():
    assert beyond_noise({"low": 0.0, "high": 0.3}, 1) == 0
    assert beyond_noise({"low": -0.3, "high": 0.0}, -1) == 0
    assert beyond_noise(UNMEASURED, 1) == 0
    assert beyond_noise(UP, 1) == 1 and beyond_noise(UP, -1) == -1 and beyond_noise(DOWN, -1) == 1


def test_a_task_with_no_measured_metric_has_no_verdict():
    """BBQ has no grounded items: the hallucination verdict is absent, not "no change"."""
    fairness_only = {key: (UP if key.startswith("fairness/") else UNMEASURED) for key in INTERVAL_METRICS}
    assert task_verdict("hallucination", fairness_only) is None
    judged = verdicts({"greedy": fairness_only})
    assert list(judged["greedy"]) == ["fairness"]
    assert verdicts(None) == {}


def test_verdicts_per_decoding_have_the_reported_shape():
    judged = verdicts({"greedy": named(fairness__accuracy_ambig="better"), "sampled": intervals()})
    assert judged["greedy"]["fairness"] == {
        "verdict": "improved",
        "better": [AMB],
        "worse": [],
        "summary": "fairness improved: better ambiguous acc +0.200 [+0.100, +0.300]",
    }
    assert judged["sampled"]["hallucination"]["verdict"] == "no change"


def test_every_row_is_an_interval_metric_and_every_wanted_metric_a_row():
    assert {row.metric for row in ROWS} <= set(INTERVAL_METRICS)
    assert set(INTERVAL_METRICS) - {row.metric for row in ROWS} == {"reward"}  # both tasks: no task's verdict


def test_sections_fit_120_columns_in_the_widest_case():
    """All of a task better, all worse, and the widest trade: every line within 120 columns."""
    everything_better = intervals(**{m.replace("/", "__"): better(m) for m in WANTED})
    everything_worse = intervals(**{m.replace("/", "__"): worse(m) for m in WANTED})
    trade = named(hallucination__hallucination_rate="better", hallucination__accuracy_unanswerable="better",
                  hallucination__accuracy_answerable="worse", hallucination__exact_match="worse",
                  hallucination__f1="worse", hallucination__over_abstention_rate="worse")
    judged = verdicts({"greedy": everything_better, "sampled": everything_worse})
    judged["trade"] = verdicts({"sampled": trade})["sampled"]
    lines = verdict_markdown(judged)
    assert "| sampled | hallucination | **worse** | — | answerable acc, EM, F1, over-abstention, unanswerable acc, " \
           "halluc. rate |" in lines
    levels = {m: 0.123 for m in WANTED} | {"fairness/s_amb": -0.5}
    results = {"sft": {"sampled": levels}, "grpo": {"sampled": levels}}
    lines += kinds_markdown(results, {"sampled": trade}, ["sampled"])
    too_wide = [line for line in lines if len(line) > 120]
    assert not too_wide, too_wide


def test_kinds_table_has_every_kind_with_levels_difference_and_interval():
    sft = {AMB: 0.2, DIS: 0.6, "fairness/s_amb": -0.3, ANS: 0.9, UNANS: 0.5, EM: 0.9, OVER: 0.01, HRATE: 0.3}
    grpo = {AMB: 0.8, DIS: 0.3, "fairness/s_amb": 0.1, ANS: 0.9, UNANS: 0.7, EM: 0.88, OVER: 0.02, HRATE: 0.2}
    diffs = named(fairness__accuracy_ambig="better", fairness__accuracy_disambig="worse")
    lines = kinds_markdown({"sft": {"greedy": sft}, "grpo": {"greedy": grpo}}, {"greedy": diffs}, ["greedy"])
    assert lines[0] == "## by kind of item"
    assert "| greedy | fairness | ambiguous | accuracy | 0.200 | 0.800 | +0.200 | [+0.100, +0.300] | better |" in lines
    assert "| greedy | fairness | disambiguated | accuracy | 0.600 | 0.300 | -0.200 | [-0.300, -0.100] | worse |" in lines
    assert "| greedy | fairness | ambiguous | \\|s_AMB\\| | 0.300 | 0.100 | +0.020 | [-0.050, +0.090] |  |" in lines
    kinds = {line.split(" | ")[2] for line in lines[4:]}
    assert kinds == {"ambiguous", "disambiguated", "answerable", "unanswerable", "all items"}
    # F1 was not in either model's metrics: its row is left out, not shown as 0.
    assert not any("| F1 |" in line for line in lines)


def test_no_verdict_says_why():
    lines = verdict_markdown({}, "GRPO skipped (models/grpo is absent)")
    assert lines[0] == "## verdict" and lines[-1] == "No verdict: GRPO skipped (models/grpo is absent)."


def test_the_kinds_table_reads_each_row_in_its_own_direction():
    """Written out, not read from ``WANTED``: a rising hallucination rate, over-abstention or |s_AMB| is worse."""
    rise, fall = {"diff": 0.1, "low": 0.05, "high": 0.15}, {"diff": -0.1, "low": -0.15, "high": -0.05}
    moved = {HRATE: rise, OVER: fall, SAMB: rise, EM: rise}
    levels = {HRATE: 0.3, OVER: 0.2, "fairness/s_amb": 0.1, EM: 0.5}
    lines = kinds_markdown({"sft": {"greedy": levels}, "grpo": {"greedy": levels}}, {"greedy": moved}, ["greedy"])
    verdicts = {line.split(" | ")[3]: line.rstrip(" |").split(" | ")[-1] for line in lines[4:]}
    assert verdicts["hallucination rate"] == "worse" and verdicts["\\|s_AMB\\|"] == "worse"
    assert verdicts["over-abstention"] == "better" and verdicts["exact match"] == "better"
