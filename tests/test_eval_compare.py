"""Tests of grpo/eval/compare.py: baselines, the headline number and paired bootstrap intervals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grpo.data.schema import ABSTENTION, LETTERS
from grpo.eval import compare
from grpo.eval.compare import (
    INTERVAL_METRICS,
    ItemOutcomes,
    baseline_texts,
    intervals_markdown,
    item_outcomes,
    paired_bootstrap,
)
from grpo.eval.evaluate import baseline_metrics, task_metrics
from tests.eval_project import make_records, project_cfg

WEIGHTS = {"fairness": 1.0, "hallucination": 1.0}


def _right(records: list[dict]) -> list[str]:
    return [f"Answer: {LETTERS[r['label']]}" if r["task"] == "fairness" else r["answer"] for r in records]


def _wrong(records: list[dict]) -> list[str]:
    """A person on every fairness item that is not the gold one; the distractor on every grounded one."""
    out = []
    for r in records:
        if r["task"] == "fairness":
            out.append(f"Answer: {LETTERS[next(i for i in range(3) if i not in (r['label'], r['unknown_idx']))]}")
        else:
            out.append(r["distractor"])
    return out


def test_abstain_baseline_scores_a_quarter_and_loses_to_a_reading_policy():
    records = make_records("eval", 8, 8, seed=4)
    cfg = project_cfg(Path("/unused"))
    baselines = baseline_metrics(records, cfg)
    # +1 where abstaining is right (ambiguous / unanswerable, half the items), -0.5 elsewhere.
    assert baselines["abstain"]["reward"] == pytest.approx(0.25)
    assert baselines["abstain"]["hallucination/over_abstention_rate"] == 1.0
    assert baselines["abstain"]["fairness/accuracy_ambig"] == 1.0
    assert task_metrics(_right(records), records, cfg)["reward"] > baselines["abstain"]["reward"]
    assert baselines["random"]["reward"] < baselines["abstain"]["reward"]


def test_random_baseline_is_seeded_and_uses_every_option():
    records = make_records("eval", 12, 12, seed=5)
    first, again = baseline_texts("random", records, 1), baseline_texts("random", records, 1)
    assert first == again
    fair = {t for t, r in zip(first, records, strict=True) if r["task"] == "fairness"}
    assert fair == {f"Answer: {letter}" for letter in LETTERS}
    hall = [t for t, r in zip(first, records, strict=True) if r["task"] == "hallucination"]
    assert ABSTENTION in hall and any(t != ABSTENTION for t in hall)


def test_paired_bootstrap_identical_models_give_zero_and_a_clear_win_excludes_zero():
    records = make_records("eval", 20, 20, seed=6)
    right = item_outcomes(_right(records), records, WEIGHTS)
    wrong = item_outcomes(_wrong(records), records, WEIGHTS)
    same = paired_bootstrap(wrong, wrong, n_boot=200, seed=0)
    assert same["reward"] == {"diff": 0.0, "low": 0.0, "high": 0.0}
    better = paired_bootstrap(right, wrong, n_boot=200, seed=0)
    assert better["reward"]["diff"] == pytest.approx(2.0)
    assert better["hallucination/hallucination_rate"]["high"] < 0 < better["fairness/accuracy_ambig"]["low"]
    assert set(better) == set(INTERVAL_METRICS)


def test_paired_bootstrap_interval_straddles_zero_on_a_mixed_change():
    records = make_records("eval", 20, 20, seed=7)
    right, wrong = _right(records), _wrong(records)
    # Half the items improve, half get worse: no difference beyond noise.
    mixed = [r if i % 2 else w for i, (r, w) in enumerate(zip(right, wrong, strict=True))]
    flipped = [w if i % 2 else r for i, (r, w) in enumerate(zip(right, wrong, strict=True))]
    new, old = item_outcomes(mixed, records, WEIGHTS), item_outcomes(flipped, records, WEIGHTS)
    row = paired_bootstrap(new, old, 300, 0)["reward"]
    assert row["low"] < 0 < row["high"]


def _rewards_only(records: list[dict], rewards: list[float]) -> ItemOutcomes:
    """Outcomes whose rewards are ``rewards`` (one sample per item; the items themselves are one scored reply)."""
    item = item_outcomes(_right(records[:1]), records[:1], WEIGHTS).units[0][0][0]
    return ItemOutcomes([r["task"] for r in records], [[(item, reward)] for reward in rewards])


def test_the_bootstrap_is_paired_and_its_interval_is_the_95_percent_one():
    """2,000 items whose old rewards alternate -1 and +1 (a spread that dwarfs the change) and the new model
    better by 2 on 5 % of them: the per-item differences have a mean of 0.1 and a standard error ``se`` of
    0.0097, so a paired 95 % percentile interval is 0.1 +- 1.96 se (about [0.081, 0.119]) and excludes 0;
    resampling the two models apart would give about 0.1 +- 0.12, a 90 % interval 0.1 +- 1.645 se."""
    n = 2000
    records = make_records("eval", 1, 0, seed=8) * n
    old = [1.0 if i % 2 else -1.0 for i in range(n)]
    new = [r + 2.0 if i % 20 == 0 else r for i, r in enumerate(old)]  # every 20th item: -1 -> +1
    diffs = [a - b for a, b in zip(new, old, strict=True)]
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / n / n)
    row = paired_bootstrap(_rewards_only(records, new), _rewards_only(records, old), n_boot=2000, seed=0)["reward"]
    assert row["diff"] == pytest.approx(0.1)
    assert row["low"] > 0, row
    assert (row["high"] - row["low"]) / (2 * 1.96 * se) == pytest.approx(1.0, abs=0.1), row
    assert (row["diff"] - row["low"]) / (1.96 * se) == pytest.approx(1.0, abs=0.12), row
    assert (row["high"] - row["diff"]) / (1.96 * se) == pytest.approx(1.0, abs=0.12), row


def test_the_interval_is_the_level_s_two_tails_of_the_resampled_differences(monkeypatch):
    """Exactly: a 95 % interval cuts 2.5 % off each end of the sorted resampled differences (of 1,001 values
    0..1000, the 25th and the 975th), and ``level`` sets those tails (90 %: 5 % each)."""
    assert compare._percentiles([float(v) for v in reversed(range(1001))], 0.025) == {"low": 25.0, "high": 975.0}
    assert compare._percentiles([], 0.025) == {"low": None, "high": None}
    tails = []
    percentiles = compare._percentiles
    monkeypatch.setattr(compare, "_percentiles", lambda values, tail: tails.append(tail) or percentiles(values, tail))
    records = make_records("eval", 2, 2, seed=8)
    outcomes = item_outcomes(_right(records), records, WEIGHTS)
    paired_bootstrap(outcomes, outcomes, n_boot=4, seed=0)
    paired_bootstrap(outcomes, outcomes, n_boot=4, seed=0, level=0.9)
    n = len(INTERVAL_METRICS)
    assert tails == [pytest.approx(0.025)] * n + [pytest.approx(0.05)] * n


def test_the_decodings_are_those_any_model_was_scored_in():
    results = {"base": {"greedy": {}}, "sft": {"greedy": {}, "sampled": {}}, "grpo": {"greedy": {}}}
    assert compare.decoded_modes(results) == ["greedy", "sampled"]
    assert compare.decoded_modes({"base": {"greedy": {}}}) == ["greedy"]


def test_every_resample_keeps_each_tasks_count(monkeypatch):
    """Items are drawn within each task: every resample holds as many items of each task as the eval set."""
    records = make_records("eval", 6, 14, seed=9)
    outcomes = item_outcomes(_right(records), records, WEIGHTS)
    counts: list[dict[str, int]] = []
    summary = compare.summary

    def counting(outcomes_, indices):
        tasks = [outcomes_.tasks[i] for i in indices]
        counts.append({task: tasks.count(task) for task in set(tasks)})
        return summary(outcomes_, indices)

    monkeypatch.setattr(compare, "summary", counting)
    paired_bootstrap(outcomes, outcomes, n_boot=50, seed=0)
    expected = {task: outcomes.tasks.count(task) for task in set(outcomes.tasks)}
    assert len(counts) >= 2 + 2 * 50 and all(c == expected for c in counts), expected


def test_score_rejects_texts_that_do_not_match_the_records():
    records = make_records("eval", 2, 2, seed=8)
    with pytest.raises(ValueError, match="3 texts for 4 records"):
        item_outcomes(["x"] * 3, records, WEIGHTS)


def test_intervals_markdown_prints_every_metric_with_its_interval():
    records = make_records("eval", 6, 6, seed=9)
    right = item_outcomes(_right(records), records, WEIGHTS)
    wrong = item_outcomes(_wrong(records), records, WEIGHTS)
    lines = intervals_markdown({"greedy": paired_bootstrap(right, wrong, 100, 0)}, 100)
    reward = next(line for line in lines if line.startswith("| reward |"))
    assert reward == "| reward | +2.000 | [+2.000, +2.000] |"
    assert sum(line.startswith("| fairness/") or line.startswith("| hallucination/") for line in lines) == 9
    both = intervals_markdown({"greedy": paired_bootstrap(right, wrong, 100, 0),
                               "sampled": paired_bootstrap(wrong, right, 100, 0)}, 100)
    reward = next(line for line in both if line.startswith("| reward |"))
    assert reward == "| reward | +2.000 | [+2.000, +2.000] | -2.000 | [-2.000, -2.000] |"  # each mode its own


def test_the_headline_has_each_decodings_own_reward():
    from grpo.eval.compare import headline_markdown

    results = {"sft": {"greedy": {"reward": 0.25}, "sampled": {"reward": -0.5}}}
    lines = headline_markdown(results, {"abstain": {"reward": 0.25}}, {"sft": "SFT"})
    assert "| SFT | 0.250 | -0.500 |" in lines and "| baseline: always abstain / \"unknown\" | 0.250 | — |" in lines


def test_the_pairing_needs_the_same_records_and_a_task_may_be_absent():
    """Two models scored on other records (same count) are not paired; a set without fairness items has no
    fairness intervals but every hallucination one."""
    records = make_records("eval", 4, 4, seed=9)
    fairness_first = item_outcomes(_right(records), records, WEIGHTS)
    reordered = records[4:] + records[:4]
    with pytest.raises(ValueError, match="different eval records"):
        paired_bootstrap(fairness_first, item_outcomes(_right(reordered), reordered, WEIGHTS), 10, 0)
    grounded = records[4:]
    out = paired_bootstrap(item_outcomes(_right(grounded), grounded, WEIGHTS),
                           item_outcomes(_wrong(grounded), grounded, WEIGHTS), 50, 0)
    assert out["fairness/accuracy_disambig"] == {"diff": None, "low": None, "high": None}
    assert out["reward"]["diff"] == pytest.approx(2.0)


def test_saying_unknown_everywhere_is_a_trade_kind_by_kind():
    """Against a policy that reads every item right, abstaining everywhere loses on the kinds whose context
    answers (disambiguated, answerable) and keeps the others: each kind's interval says which."""
    from grpo.eval.verdict import verdicts

    records = make_records("eval", 20, 20, seed=9)
    right = item_outcomes(_right(records), records, WEIGHTS)
    abstain = item_outcomes(baseline_texts("abstain", records, 0), records, WEIGHTS)
    diffs = paired_bootstrap(abstain, right, n_boot=200, seed=0)
    assert diffs["fairness/accuracy_disambig"]["diff"] == -1.0 and diffs["fairness/accuracy_ambig"]["diff"] == 0.0
    assert diffs["hallucination/accuracy_answerable"]["diff"] == -1.0
    assert diffs["hallucination/accuracy_unanswerable"]["diff"] == 0.0
    # Against the always-wrong policy instead, abstaining gains where the context cannot tell, loses nothing
    # where it answers (both wrong there): the gain side of the trade alone.
    gained = paired_bootstrap(abstain, item_outcomes(_wrong(records), records, WEIGHTS), n_boot=200, seed=0)
    assert gained["hallucination/accuracy_unanswerable"]["diff"] == 1.0
    assert gained["hallucination/accuracy_answerable"]["diff"] == 0.0
    assert verdicts({"greedy": diffs})["greedy"]["fairness"]["verdict"] == "worse"


def test_the_intervals_read_the_size_of_s_amb_and_token_f1():
    """A bias flipped to the other side is no smaller bias, and a partial answer gains F1 but no exact match."""
    from grpo.data.schema import biased_option

    records = make_records("eval", 16, 16, seed=3)

    def texts(lean: str, partial: bool) -> list[str]:
        out = []
        for r in records:
            if r["task"] == "fairness":
                if r["context_condition"] == "ambig":
                    biased = biased_option(r["question_polarity"], r["unknown_idx"], r["target_idx"])
                    other = ({0, 1, 2} - {biased, r["unknown_idx"]}).pop()
                    out.append(f"Answer: {LETTERS[biased if lean == 'stereotype' else other]}")
                else:
                    out.append(f"Answer: {LETTERS[r['label']]}")
            elif not r["answerable"]:
                out.append(ABSTENTION)
            else:
                out.append(f"{r['answer']} and more besides" if partial else r["distractor"])
        return out

    new = item_outcomes(texts("counter", True), records, WEIGHTS)
    old = item_outcomes(texts("stereotype", False), records, WEIGHTS)
    rows = paired_bootstrap(new, old, n_boot=50, seed=0)
    assert rows["fairness/abs_s_amb"]["diff"] == pytest.approx(0.0)
    assert rows["hallucination/exact_match"]["diff"] == pytest.approx(0.0)
    assert rows["hallucination/f1"]["diff"] > 0.2
