"""Monitor: its rules over recorded metric streams (a real deadlock, a healthy run), each rule's exact
condition, and the checkpoint a stop names (the chat-boundary checks: test_monitor_boundary.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from grpo.config import MonitorConfig, RuleConfig
from grpo.health import monitor as monitor_module
from grpo.health.monitor import Finding, Monitor, TrainingStopped, raise_if_stop
from grpo.train.trainer import watch
from tests.steps import stage_result

EOT = "<|eot_id|>"


def deadlock_timeline(last: int = 40) -> list[tuple[int, dict]]:
    """The recorded shape of a real run: deadlock 1-12, learning 13-20, collapse from 21.

    Steps 1-12: every group's rewards equal (all 0), a little KL noise keeps loss and grad non-zero.
    Steps 13-20: rewards vary, the model learns. From 21: reward 1.0 everywhere, reward_std 0,
    entropy decaying 0.04 -> 0.006, loss and grad norms exactly 0, every completion the same length.
    """
    stream = []
    for step in range(1, last + 1):
        if step <= 12:
            m = {"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "entropy": 0.6 - 0.01 * step,
                 "loss": 2e-5, "grad_norm": 1e-3, "completions/min_length": 3.0 + step % 2,
                 "completions/max_length": 12.0, "completions/mean_length": 6.0 + 0.1 * step}
        elif step <= 20:
            m = {"reward": 0.1 * (step - 12), "reward_std": 0.45, "frac_reward_zero_std": 0.25,
                 "entropy": 0.45 - 0.05 * (step - 12), "loss": 0.04, "grad_norm": 0.3,
                 "completions/min_length": 3.0, "completions/max_length": 10.0 - (step - 13) * 0.5,
                 "completions/mean_length": 5.0 - 0.1 * (step - 12)}
        else:
            m = {"reward": 1.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0,
                 "entropy": 0.04 * (0.006 / 0.04) ** ((step - 21) / (last - 21)), "loss": 0.0, "grad_norm": 0.0,
                 "grad_norm/fairness": 0.0, "grad_norm/hallucination": 0.0, "completions/min_length": 4.0,
                 "completions/max_length": 4.0, "completions/mean_length": 4.0}
        stream.append((step, m | {"step_time": 1.2, "completions/clipped_ratio": 0.0, "logits/max_prob": 0.9}))
    return stream


def fired(monitor: Monitor, stream) -> list[tuple[str, int]]:
    return [(f.rule, f.step) for step, metrics in stream for f in monitor.observe(step, metrics)]


def first_stop(monitor: Monitor, stream) -> TrainingStopped:
    """Run the stream the way the trainer does: raise_if_stop after every step."""
    for step, metrics in stream:
        try:
            raise_if_stop(monitor.observe(step, metrics))
        except TrainingStopped as stop:
            return stop
    raise AssertionError("the stream never stopped")


def test_deadlock_rule_fires_at_window_of_each_zero_std_streak():
    """Default window 5: the deadlock present from step 1 fires at 5 (it is the same disease: no
    advantage to learn from), nothing fires while the model learns (13-20), the late deadlock fires
    at 21 + 5 - 1 = 25."""
    events = fired(Monitor(MonitorConfig()), deadlock_timeline())
    assert [s for rule, s in events if rule == "reward_zero_std"] == [5, 25]
    assert not [e for e in events if 13 <= e[1] <= 20]


def test_deadlock_with_a_window_longer_than_the_initial_streak_fires_only_late():
    cfg = MonitorConfig(reward_zero_std=RuleConfig(threshold=0.9, window=15))
    events = fired(Monitor(cfg), deadlock_timeline())
    assert [s for rule, s in events if rule == "reward_zero_std"] == [21 + 15 - 1]


def test_late_deadlock_stops_with_a_diagnosis():
    """A run resumed after the first deadlock: zero loss/grad (window 3) stops it at 23, and the
    reward_std rule alone would stop it at 25."""
    stream = [(s, m) for s, m in deadlock_timeline() if s >= 13]
    stop = first_stop(Monitor(MonitorConfig()), stream)
    assert [(f.rule, f.step, f.since) for f in stop.findings] == [("zero_grad", 23, 21)]
    assert stop.since == 21 and "(0, 0, 0, 0)" in str(stop)
    alone = MonitorConfig(zero_grad=RuleConfig(threshold=0.0, window=3, action="off"))
    stop = first_stop(Monitor(alone), stream)
    assert [(f.rule, f.step) for f in stop.findings] == [("reward_zero_std", 25)]
    message = str(stop)
    assert "reward_zero_std" in message and "frac_reward_zero_std >= 0.9 for 5 steps (21-25): 1, 1, 1, 1, 1" in message
    for cause in ("same reward", "advantage all zero", "I7", "entropy_coef", "temperature", "beta", "I9"):
        assert cause in message, cause


def test_entropy_floor_fires_after_window_steps_below_the_floor():
    stream = deadlock_timeline()
    first_below = min(s for s, m in stream if m["entropy"] < 0.01)
    events = fired(Monitor(MonitorConfig()), stream)
    assert [s for rule, s in events if rule == "entropy_floor"] == [first_below + 4]


def test_frozen_lengths_warn():
    events = fired(Monitor(MonitorConfig()), deadlock_timeline())
    assert [s for rule, s in events if rule == "lengths_frozen"] == [30]


def test_healthy_stream_triggers_nothing(caplog):
    rng = np.random.default_rng(0)
    monitor = Monitor(MonitorConfig())
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        for step in range(1, 101):
            low = float(rng.integers(2, 6))
            metrics = {
                "reward": float(rng.uniform(-0.5, 0.8)), "reward_std": float(rng.uniform(0.3, 0.7)),
                "frac_reward_zero_std": float(rng.uniform(0.0, 0.5)), "entropy": float(2.0 + 0.2 * rng.normal()),
                "loss": float(rng.normal(0, 0.05)), "grad_norm": float(rng.uniform(0.1, 1.0)),
                "grad_norm/fairness": float(rng.uniform(0.1, 1.0)), "grad_norm/hallucination": float(rng.uniform(0.1, 1)),
                "completions/min_length": low, "completions/max_length": low + float(rng.integers(5, 18)),
                "completions/mean_length": low + float(rng.uniform(2, 5)),
                "completions/clipped_ratio": float(rng.uniform(0, 0.2)), "step_time": float(rng.uniform(0.8, 1.5)),
                "logits/max_prob": float(rng.uniform(0.5, 0.8)),
            }
            assert monitor.observe(step, metrics) == [], step
    assert not caplog.records


# rule: (metric, the comparison its description states). A user sets a threshold by that description:
# reward_zero_std at 1.0 means "every group frozen", and must fire when every group is.
def only(rule: str, threshold: float, window: int) -> MonitorConfig:
    """A monitor with ``rule`` alone on (warn), every other rule off."""
    config = MonitorConfig(**{rule: RuleConfig(threshold=threshold, window=window, action="warn")})
    return config.model_copy(update={
        other: RuleConfig(threshold=0.0, window=1, action="off")
        for other in (*monitor_module.BOUNDARY_METRIC_RULES, *monitor_module.COLLAPSE_RULES) if other != rule
    })


THRESHOLD_RULES = {
    "boundary_clipped": ("completions/clipped_ratio", ">"),
    "boundary_entropy_low": ("entropy", "<"),
    "boundary_entropy_high": ("entropy", ">"),
    "entropy_floor": ("entropy", "<"),
    "reward_zero_std": ("frac_reward_zero_std", ">="),
    "step_time": ("step_time", "<"),
    "max_prob": ("logits/max_prob", ">="),
}


@pytest.mark.parametrize("rule", sorted(THRESHOLD_RULES))
def test_each_rule_compares_at_its_threshold_as_its_description_says(rule):
    """At the threshold itself a rule fires exactly when its comparison includes equality; a step past it
    fires, a step short of it does not; and the finding's text states that comparison."""
    metric, comparison = THRESHOLD_RULES[rule]
    threshold = 1.0
    config = only(rule, threshold, 1)
    past = {"<": 0.5, ">": 1.5, ">=": 1.5}[comparison]
    short = {"<": 1.5, ">": 0.5, ">=": 0.5}[comparison]
    for value, fires in ((threshold, comparison == ">="), (past, True), (short, False)):
        findings = Monitor(config).observe(1, {metric: value})
        assert [f.rule for f in findings] == ([rule] if fires else []), f"{rule} at {metric} = {value}"
    (finding,) = Monitor(config).observe(1, {metric: past})
    assert f"{metric} {comparison} 1" in finding.message, finding.message


@pytest.mark.parametrize(
    ("rules", "first_cause"),
    [
        (["entropy_floor"], "reward degeneracy"),
        (["entropy_floor", "boundary_header"], "the chat template differs"),  # any boundary finding: its causes
        (["boundary_header", "entropy_floor"], "the chat template differs"),
        (["entropy_floor", "kind_trade"], "the reward pays too much"),  # a trade's before a collapse's
    ],
)
def test_a_stop_names_every_finding_and_the_numbered_causes_of_its_kind(rules, first_cause):
    """The stop message lists each stopping finding, then the causes of the most specific kind among them
    (a boundary finding's, else a trade's, else a collapse's), numbered from 1."""
    findings = [Finding(rule, "stop", 7, f"{rule} fired") for rule in rules]
    with pytest.raises(TrainingStopped) as stop:
        raise_if_stop(findings)
    message = str(stop.value)
    assert all(f"  - {rule}: {rule} fired" in message for rule in rules)
    assert f"likely causes, most common first:\n  1. {first_cause}" in message, message


def test_warn_findings_do_not_stop():
    raise_if_stop([Finding("lengths_frozen", "warn", 9, "frozen")])


def test_rule_turned_off_never_fires():
    cfg = MonitorConfig(reward_zero_std=RuleConfig(threshold=0.9, window=1, action="off"))
    assert Monitor(cfg).observe(10, {"frac_reward_zero_std": 1.0}) == []


def test_missing_metric_is_warned_once_and_never_fires(caplog):
    monitor = Monitor(MonitorConfig())
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        for step in range(10, 20):
            assert monitor.observe(step, {"entropy": 1.0}) == []
    missing = [r.getMessage() for r in caplog.records if "reward_zero_std" in r.getMessage()]
    assert len(missing) == 1 and "no metric" in missing[0]


def test_a_step_without_the_metric_breaks_the_streak():
    """Unknown is not "holds": a step that lacks the rule's metric starts its window again, so two steps
    before the gap and two after it are no window of three; the third after it is."""
    monitor = Monitor(only("reward_zero_std", 0.9, 3))
    stream = [(1, {"frac_reward_zero_std": 1.0}), (2, {"frac_reward_zero_std": 1.0}), (3, {"reward": 0.0}),
              (4, {"frac_reward_zero_std": 1.0}), (5, {"frac_reward_zero_std": 1.0}),
              (6, {"frac_reward_zero_std": 1.0})]
    assert fired(monitor, stream) == [("reward_zero_std", 6)]


def test_zero_grad_needs_the_loss_and_every_gradient_norm_at_zero():
    """A GRPO loss is often 0 while its gradient is not (zero-mean advantages at ratio 1), and one task's
    gradient may vanish while the other's does not: neither is a frozen step."""
    monitor = Monitor(only("zero_grad", 0.0, 1))
    assert monitor.observe(1, {"loss": 0.0, "grad_norm": 0.3}) == []
    assert monitor.observe(2, {"loss": 0.0, "grad_norm": 0.0, "grad_norm/fairness": 0.2}) == []
    assert [f.rule for f in monitor.observe(3, {"loss": 0.0, "grad_norm": 0.0, "grad_norm/fairness": 0.0})] == [
        "zero_grad"]


def test_uniform_lengths_that_change_from_step_to_step_are_not_frozen():
    """Every completion of a step the same length is frozen only while that length stays: lengths of 4, 5
    and 6 tokens on three steps in a row are not; after a step of mixed lengths, 7 held for three steps is."""
    monitor = Monitor(only("lengths_frozen", 0.0, 3))
    lengths = [(4.0, 4.0), (5.0, 5.0), (6.0, 6.0), (3.0, 8.0), (7.0, 7.0), (7.0, 7.0), (7.0, 7.0)]
    stream = [(step, {"completions/min_length": low, "completions/max_length": high,
                      "completions/mean_length": (low + high) / 2})
              for step, (low, high) in enumerate(lengths, start=1)]
    assert fired(monitor, stream) == [("lengths_frozen", 7)]


# --------------------------------------------------------------------------- the checkpoint to go back to


@pytest.mark.parametrize(
    ("since", "checkpoints", "hint"),
    [
        # table: the window's first step, the run's checkpoint steps (None: unknown) -> what the stop says
        (1, None, "No checkpoint was written before step 1, so there is no healthy one to go back to: fix the "
                  "cause and rerun `grpo train`, which starts again from the SFT model."),
        (1, [5], "No checkpoint was written before step 1"),
        (3, [5, 10], "No checkpoint was written before step 3"),  # a boundary stop before the first save
        (8, [], "No checkpoint was written before step 8"),
        (8, [5, 10], "The checkpoint of step 5, the last before step 8, is the last healthy one."),
        (11, [5, 10], "The checkpoint of step 10, the last before step 11, is the last healthy one."),
        (8, None, "The last checkpoint before step 8, if one was written, is the last healthy one."),
    ],
)
def test_the_stop_names_a_checkpoint_to_go_back_to_only_when_one_exists(since, checkpoints, hint):
    finding = Finding("entropy_floor", "stop", since + 4, "entropy < 0.01", since)
    message = str(TrainingStopped([finding], checkpoints))
    assert hint in message and "set monitor.entropy_floor.action: warn" in message
    assert ("before step 1 is" not in message) and ("checkpoint of step" in message) == bool(
        [c for c in checkpoints or () if c < since])


@pytest.mark.parametrize("saved", [[], [1], [1, 2]])
def test_the_trainers_stop_names_the_checkpoints_on_disk(tiny_tokenizer, tmp_path, saved):
    """``watch`` reads the run folder only when it stops: the checkpoint of step 1 is named at a stop in
    step 3 whose window opened at step 2 (one of step 2 is not: it is inside the window); none saved yet:
    no checkpoint is named, and the hint says to rerun from the SFT model."""
    from grpo.config import RuleConfig
    from grpo.train.checkpoint import save_checkpoint

    for step in saved:
        save_checkpoint(tmp_path, step, model=torch.nn.Linear(2, 2), optimizer=None, scheduler=None, rng={},
                        history=[], lineage={}, keep_last=5)
    eot = tiny_tokenizer.convert_tokens_to_ids(EOT)
    result = stage_result(tiny_tokenizer, [eot], [[eot]] * 4)  # every completion empty
    monitor = Monitor(MonitorConfig(boundary_empty=RuleConfig(threshold=1.0, window=2)))
    watch(monitor, 2, result, tmp_path)  # window 2: the first empty step only counts
    with pytest.raises(TrainingStopped) as stop:
        watch(monitor, 3, result, tmp_path)
    if 1 in saved:
        assert "The checkpoint of step 1, the last before step 2, is the last healthy one." in str(stop.value)
    else:
        assert "No checkpoint was written before step 2" in str(stop.value)


def test_a_stop_by_several_rules_goes_back_before_the_earliest_window():
    """Two rules stop the same step, their windows opened at steps 8 and 10: the run went wrong at 8, so
    the checkpoint of step 9 (inside the earlier window) is not healthy and the one of step 5 is named."""
    findings = [Finding("zero_grad", "stop", 12, "frozen", 10), Finding("entropy_floor", "stop", 12, "low", 8)]
    stop = TrainingStopped(findings, [5, 9])
    assert stop.since == 8
    assert "The checkpoint of step 5, the last before step 8, is the last healthy one." in str(stop)


def test_a_negative_loss_with_zero_gradients_is_not_a_frozen_step():
    """The rule reads |loss|: a loss of -0.3 is as far from 0 as +0.3."""
    monitor = Monitor(only("zero_grad", 0.0, 1))
    assert monitor.observe(1, {"loss": -0.3, "grad_norm": 0.0, "grad_norm/fairness": 0.0}) == []
    assert [f.rule for f in monitor.observe(2, {"loss": 0.0, "grad_norm": 0.0})] == ["zero_grad"]


def test_the_default_monitor_stops_an_entropy_collapse_within_its_window():
    """Entropy under the floor from step 11 on, everything else healthy: the default monitor stops the run
    by ``entropy_floor`` at step 11 + 5 - 1 = 15, not with a warning that lets it train on."""
    healthy = {"frac_reward_zero_std": 0.2, "loss": 0.05, "grad_norm": 0.4, "completions/min_length": 3.0,
               "completions/max_length": 12.0, "completions/mean_length": 6.0, "completions/clipped_ratio": 0.0,
               "step_time": 1.0, "logits/max_prob": 0.8}
    stream = [(step, healthy | {"entropy": 0.005}) for step in range(11, 30)]
    stop = first_stop(Monitor(MonitorConfig()), stream)
    assert [(f.rule, f.step, f.since) for f in stop.findings] == [("entropy_floor", 15, 11)]


def findings_of(monitor: Monitor, stream) -> list[Finding]:
    return [f for step, metrics in stream for f in monitor.observe(step, metrics)]


@pytest.mark.parametrize("resumed_at", [3, 12, 16, 23, 25, 30])
def test_a_resumed_run_finds_what_the_uninterrupted_run_finds_after_its_checkpoint(resumed_at):
    """A run resumed from the checkpoint of step ``resumed_at`` (its restored history) fires every rule at the
    step, with the message, the uninterrupted run does: a collapse under way at the checkpoint keeps its
    streak (stopped at step ``window``, not ``window`` steps after the resume), one that fired before it
    does not fire again, and ``lengths_frozen`` compares the first new step with the restored last one."""
    cfg = MonitorConfig()
    stream = deadlock_timeline()
    whole = [f for f in findings_of(Monitor(cfg), stream) if f.step > resumed_at]
    history = [{"step": step, **metrics} for step, metrics in stream[:resumed_at]]
    resumed = findings_of(Monitor(cfg, history), stream[resumed_at:])
    assert resumed == whole
    assert any(f.rule in ("reward_zero_std", "entropy_floor", "zero_grad") for f in whole)


def test_replaying_the_history_neither_logs_nor_returns_its_findings(caplog):
    """The restored steps' findings were the interrupted run's: replaying them says nothing again."""
    history = [{"step": step, **metrics} for step, metrics in deadlock_timeline()[:30]]
    with caplog.at_level(logging.WARNING, logger=monitor_module.__name__):
        Monitor(MonitorConfig(), history)
    assert caplog.records == []
