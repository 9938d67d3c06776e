"""grpo/health/kinds.py: per-kind reward and abstention of a step, and the trend rules on planted streams."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from grpo.config import MonitorConfig, RuleConfig, config_from_dict
from grpo.health.kinds import (
    TRADE_RULES,
    abstention_rise,
    halves,
    kind_counts,
    kind_stats,
    kind_trade,
    progress,
)
from grpo.health.metrics import read_metrics
from grpo.health.monitor import Monitor, TrainingStopped, raise_if_stop
from grpo.health.process_merge import merge_process_metrics
from tests.tiny_project import prepared_project, run_stages

CHOICES = ["the grandfather", "the grandson", "Can't be determined"]


def fair(condition: str) -> dict:
    label = 2 if condition == "ambig" else 0
    return {"id": f"f-{condition}", "task": "fairness", "choices": CHOICES, "label": label, "unknown_idx": 2,
            "target_idx": 0, "context_condition": condition, "question_polarity": "neg"}


def grounded(answerable: bool) -> dict:
    return {"id": f"h-{answerable}", "task": "hallucination", "answerable": answerable,
            "answer": "Mara Venn" if answerable else "I don't know.", "aliases": []}


def test_kind_stats_of_a_step_that_says_unknown_everywhere():
    """Group size 2; each record answered once "unknown"/abstaining and once otherwise."""
    records = [fair("ambig"), fair("disambig"), grounded(True), grounded(False)]
    texts = ["Answer: C", "Answer: A",  # ambiguous: unknown (right), a person
             "Answer: C", "Answer: B",  # disambiguated: unknown, the wrong person
             "I don't know.", "Mara Venn",  # answerable: abstains, right
             "I don't know.", "Paris"]  # unanswerable: abstains (right), invents
    rewards = torch.tensor([1.0, -1.0, -0.5, -1.0, -0.5, 1.0, 1.0, -1.0])
    stats = kind_stats(texts, records, 2, rewards)
    assert stats == {
        "kinds/ambiguous/reward": 0.0, "kinds/ambiguous/abstention": 0.5,
        "kinds/disambiguated/reward": -0.75, "kinds/disambiguated/abstention": 0.5,
        "kinds/answerable/reward": 0.25, "kinds/answerable/abstention": 0.5,
        "kinds/unanswerable/reward": 0.0, "kinds/unanswerable/abstention": 0.5,
    }
    assert kind_counts(records[:3], 2) == {"rows/ambiguous": 2.0, "rows/disambiguated": 2.0, "rows/answerable": 2.0}
    assert progress(stats) == "amb+0.0 dis-0.8 ans+0.2 una+0.0"


def test_kind_metrics_merge_over_processes_by_their_rows():
    """Process 0 holds 2 disambiguated rows (abstention 1.0), process 1 six (abstention 0.0): 0.25 overall,
    and a kind absent on one process is the other's value."""
    metrics = [{"kinds/disambiguated/abstention": 1.0, "kinds/ambiguous/reward": 0.5},
               {"kinds/disambiguated/abstention": 0.0}]
    counts = [{"rows/disambiguated": 2.0, "rows/ambiguous": 4.0}, {"rows/disambiguated": 6.0}]
    merged = merge_process_metrics(metrics, counts)
    assert merged["kinds/disambiguated/abstention"] == 0.25 and merged["kinds/ambiguous/reward"] == 0.5


def stream(ambiguous: list[float], disambiguated: list[float], abstain: list[float] | None = None) -> list[dict]:
    out = []
    for i, (a, d) in enumerate(zip(ambiguous, disambiguated, strict=True)):
        m = {"step": i + 1, "kinds/ambiguous/reward": a, "kinds/disambiguated/reward": d}
        if abstain is not None:
            m["kinds/disambiguated/abstention"] = abstain[i]
        out.append(m)
    return out


def test_halves_compare_the_later_half_with_the_earlier_one():
    history = [{"x": v} for v in (0.0, 1.0, 9.0, 2.0, 3.0)]  # the odd middle step counts in neither half
    before, after, noise = halves(history, "x")
    # Each half's values differ by 1: standard error 0.5 each, sqrt(0.5² + 0.5²) for the difference.
    assert (before, after) == (0.5, 2.5) and noise == pytest.approx(0.5 ** 0.5)
    assert halves([{"x": 1.0}, {}, {"x": 1.0}, {"x": 2.0}], "x") is None  # one value in a half: no spread


def test_a_change_within_the_noise_of_a_small_batch_is_no_trend():
    """A disambiguated abstention rate swinging 0 / 0.5 step by step (a batch of two rows) rises by 0.3 on
    average: above the threshold, but within two standard errors."""
    noisy = [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.3, 0.8, 0.3, 0.8, 0.3, 0.8]
    holds, detail = abstention_rise(stream([0.0] * 12, [0.0] * 12, noisy), 0.25)
    assert not holds and "(+0.300, noise ±0." in detail
    steady = [0.0, 0.05] * 3 + [0.3, 0.35] * 3
    assert abstention_rise(stream([0.0] * 12, [0.0] * 12, steady), 0.25)[0]


def test_kind_trade_needs_one_kind_down_and_another_up_by_the_threshold():
    trade = stream([-0.5] * 5 + [0.5] * 5, [0.4] * 5 + [-0.2] * 5)
    holds, detail = kind_trade(trade, 0.3)
    assert holds and detail == (
        "reward of disambiguated +0.400 -> -0.200 (-0.600, noise ±0.000) while "
        "ambiguous -0.500 -> +0.500 (+1.000, noise ±0.000)"
    )
    both_up = stream([-0.5] * 5 + [0.5] * 5, [0.0] * 5 + [0.4] * 5)
    one_down_a_little = stream([-0.5] * 5 + [0.5] * 5, [0.4] * 5 + [0.2] * 5)
    assert not kind_trade(both_up, 0.3)[0] and not kind_trade(one_down_a_little, 0.3)[0]
    one_down_alone = stream([0.2] * 10, [0.4] * 5 + [-0.2] * 5)  # a fall with nothing gained is no trade
    both_down = stream([0.5] * 5 + [-0.5] * 5, [0.4] * 5 + [-0.2] * 5)
    assert not kind_trade(one_down_alone, 0.3)[0] and not kind_trade(both_down, 0.3)[0]


def test_abstention_rise_reads_only_the_kinds_whose_context_answers():
    rising = stream([0.0] * 6, [0.0] * 6, [0.0, 0.1, 0.0, 0.5, 0.6, 0.7])
    holds, detail = abstention_rise(rising, 0.25)
    assert holds and "disambiguated +0.033 -> +0.600 (+0.567, noise ±0.067)" in detail
    ambiguous_rising = [{"step": i, "kinds/ambiguous/abstention": 0.1 * i} for i in range(6)]
    assert abstention_rise(ambiguous_rising, 0.25) == (False, "no answered kind measured")


def test_a_change_of_exactly_the_threshold_is_a_move():
    """"By at least threshold": abstention moves in steps of 1/rows, so a rise of exactly 0.25 (2 of 8 rows)
    with no noise must fire."""
    exactly = stream([0.0] * 6, [0.0] * 6, [0.0] * 3 + [0.25] * 3)
    assert abstention_rise(exactly, 0.25)[0]
    assert kind_trade(stream([0.0] * 3 + [0.3] * 3, [0.3] * 3 + [0.0] * 3), 0.3)[0]


def monitor_cfg(action: str = "warn", window: int = 6) -> MonitorConfig:
    return MonitorConfig(kind_trade=RuleConfig(threshold=0.3, window=window, action=action),
                         abstention_rise=RuleConfig(threshold=0.25, window=window, action=action))


def observed(monitor: Monitor, history: list[dict]) -> list[tuple[str, int, int | None]]:
    found = []
    for m in history:
        found += [(f.rule, f.step, f.since) for f in monitor.observe(m["step"], m)]
    return found


def test_the_monitor_names_a_trade_at_the_step_it_starts_and_once():
    """Ambiguous reward climbs from step 4, disambiguated falls: over a window of 6, steps 4-6 against 1-3
    already differ by more than 0.3 each way (+0.833, -0.400) at step 6; the rule holds on and is
    reported once."""
    ambiguous = [-0.5, -0.5, -0.5, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    disambiguated = [0.4, 0.4, 0.4, 0.2, 0.0, -0.2, -0.2, -0.2, -0.2, -0.2, -0.2, -0.2]
    history = stream(ambiguous, disambiguated)
    expected = next(
        m["step"] for i, m in enumerate(history) if i + 1 >= 6 and kind_trade(history[i - 5 : i + 1], 0.3)[0]
    )
    assert expected == 6
    assert observed(Monitor(monitor_cfg()), history) == [("kind_trade", 6, 1)]


def test_a_trade_rule_turned_off_never_reports():
    history = stream([-0.5] * 6 + [0.5] * 6, [0.4] * 6 + [-0.2] * 6, [0.0] * 6 + [0.8] * 6)
    assert observed(Monitor(monitor_cfg()), history)  # the rules fire on this stream when on
    assert observed(Monitor(monitor_cfg(action="off")), history) == []


def test_a_steady_or_improving_run_never_fires(caplog):
    history = stream([0.1 * (i % 3) for i in range(30)], [0.3 + 0.01 * i for i in range(30)], [0.05] * 30)
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        assert observed(Monitor(MonitorConfig()), history) == []
    # Absent kind metrics are not "missing" (a step may hold no item of a kind): no warning either.
    assert not [r for r in caplog.records if "kind" in r.getMessage() or "abstention" in r.getMessage()]


def test_a_stop_action_raises_with_the_trade_causes():
    history = stream([0.0] * 10, [0.0] * 10, [0.0] * 5 + [0.8] * 5)
    monitor = Monitor(monitor_cfg(action="stop", window=10))
    with pytest.raises(TrainingStopped) as stop:
        for m in history:
            raise_if_stop(monitor.observe(m["step"], m))
    message = str(stop.value)
    assert "abstention_rise" in message and "step 10" in message and "rewards.abstain_when_answered" in message
    assert stop.value.since == 1


def test_a_resumed_monitor_reads_its_window_from_the_restored_history():
    """Primed with steps 1-6 of a trade that already held at step 6, the resumed monitor does not report
    it again; one primed with steps 1-5 (the trade not yet visible) reports it at step 6, as an
    uninterrupted run does."""
    history = stream([-0.5] * 3 + [0.5] * 5, [0.4] * 3 + [-0.2] * 5)
    straight = observed(Monitor(monitor_cfg()), history)
    assert straight == [("kind_trade", 6, 1)]
    assert observed(Monitor(monitor_cfg(), history[:5]), history[5:]) == straight
    assert observed(Monitor(monitor_cfg(), history[:6]), history[6:]) == []


# --------------------------------------------------------------------------- a real tiny run (slow)

# The reduced run's data and SFT (tests/test_reduced_run.py); GRPO moves fast, each task's prompts half of
# each kind, 8 rows of each kind a step.
LEARNS = {"data": {"n_train": 96, "n_eval": 64}, "sft": {"epochs": 16},
          "grpo": {"steps": 24, "prompts_per_step": 16, "group_size": 4, "lr": 0.02, "kind_share": 0.5,
                   "selection": {"rule": "last"}}}
PAYS_UNKNOWN = {"abstain_when_answered": {"fairness": 1.0, "hallucination": 1.0}}
"""The planted flaw: "unknown" / abstaining earns +1 where the context answers, as much as the right answer."""
PAYS_NOTHING = {"abstain_when_answered": {"fairness": -1.0, "hallucination": -1.0}}
"""The baseline: abstaining where the context answers earns what a wrong answer earns. (Under the default
-0.5 the tiny model, which cannot read most answers, does learn to abstain there: a real trade.)"""


@pytest.fixture(scope="module")
def learning(tmp_path_factory) -> Path:
    return prepared_project(tmp_path_factory.mktemp("trade"), **LEARNS)


def _train(source: Path, dest: Path, caplog, rewards: dict | None = None) -> tuple[list[dict], list[tuple]]:
    """A copy of the project trained (after a pre-flight under other rewards); its per-step metrics and
    the trend findings the monitor logged, ``(rule, step)``."""
    shutil.copytree(source.parent, dest, ignore=shutil.ignore_patterns("runs"))
    tree = yaml.safe_load((dest / "params.yaml").read_text().replace(str(source.parent), str(dest)))
    stages = ["train"]
    if rewards is not None:
        tree["rewards"] = rewards
        stages = ["preflight", "train"]  # the gate reads the rewards
    (dest / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        run_stages(dest / "params.yaml", *stages)
    found = [(r.args[0], r.args[1]) for r in caplog.records if r.args and r.args[0] in TRADE_RULES]
    return read_metrics(dest / "runs" / "tiny" / "metrics.jsonl"), found


def first_holding(rows: list[dict], rule: str, cfg: RuleConfig) -> int | None:
    """The first step at which ``rule`` holds over the recorded stream (the rule replayed, not the monitor)."""
    condition = {"kind_trade": kind_trade, "abstention_rise": abstention_rise}[rule]
    for end in range(cfg.window, len(rows) + 1):
        if condition(rows[end - cfg.window : end], cfg.threshold)[0]:
            return rows[end - 1]["step"]
    return None


@pytest.mark.slow
def test_a_planted_trade_is_named_at_its_step_and_the_baseline_is_not(learning, tmp_path, caplog):
    """Paying "unknown" where the context answers makes the policy say it there: the abstention rule fires
    at the first step the recorded stream shows the rise over its window. The same run where abstaining
    there pays nothing fires no trade rule."""
    rules = config_from_dict({}).monitor
    rows, found = _train(learning, tmp_path / "paid", caplog, PAYS_UNKNOWN)
    expected = first_holding(rows, "abstention_rise", rules.abstention_rise)
    assert expected is not None, "the planted reward did not make the policy abstain where the context answers"
    assert ("abstention_rise", expected) in found and min(s for r, s in found if r == "abstention_rise") == expected
    rows, found = _train(learning, tmp_path / "baseline", caplog, PAYS_NOTHING)
    assert found == []
    assert all(first_holding(rows, rule, getattr(rules, rule)) is None for rule in TRADE_RULES)


def test_a_trade_names_the_first_step_of_its_own_window():
    """kind_trade over 4 steps beside abstention_rise over 8 (the monitor keeps 8 steps): the trade seen
    at step 12 over steps 9-12 names step 9, not the oldest step the monitor keeps."""
    cfg = MonitorConfig(kind_trade=RuleConfig(threshold=0.3, window=4, action="warn"),
                        abstention_rise=RuleConfig(threshold=0.25, window=8, action="warn"))
    history = stream([0.0] * 10 + [1.0] * 2, [0.5] * 10 + [-0.5] * 2)
    assert observed(Monitor(cfg), history) == [("kind_trade", 12, 9)]


def test_a_trend_rule_reads_exactly_its_last_window_steps():
    """Window 4 at step 6 compares steps 3-4 with 5-6: a stray value at step 2, outside the window, must
    neither hide the trade nor delay it."""
    ambiguous = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # step 2 strays up; the climb starts at step 5
    disambiguated = [0.5, 0.5, 0.5, 0.5, -0.5, -0.5]
    assert observed(Monitor(monitor_cfg(window=4)), stream(ambiguous, disambiguated)) == [("kind_trade", 6, 3)]


def test_abstention_rise_watches_every_kind_whose_context_answers():
    """Answerable abstention climbs while disambiguated stays flat: the rise is named on answerable."""
    history = [{"step": i + 1, "kinds/disambiguated/abstention": 0.1,
                "kinds/answerable/abstention": 0.0 if i < 3 else 0.6} for i in range(6)]
    holds, detail = abstention_rise(history, 0.25)
    assert holds and "answerable +0.000 -> +0.600" in detail


def test_the_default_monitor_names_a_trade_and_an_abstention_rise():
    """Under params' defaults (window 10, warn) both trend rules watch a run: a planted trade and a planted
    rise in "unknown" on disambiguated items are each named at step 10, whose window opened at step 1."""
    history = stream([-0.5] * 5 + [0.5] * 5, [0.4] * 5 + [-0.2] * 5, [0.0] * 5 + [0.8] * 5)
    found = observed(Monitor(MonitorConfig()), history)
    assert sorted(found) == [("abstention_rise", 10, 1), ("kind_trade", 10, 1)]
