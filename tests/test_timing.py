"""grpo/core/timing.py: each phase's wall-clock seconds, added up over its runs, and its share of the step."""

from __future__ import annotations

import time

import pytest

from grpo.core.timing import PHASES, PhaseTimer


def test_a_phase_counts_wall_clock_time_and_adds_up_over_its_runs():
    """Sleeping is wall-clock time, not the process's CPU time; a phase run twice in a step (dynamic
    resampling draws again) reports both runs."""
    timer = PhaseTimer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.03)
    with timer("reward"):
        pass
    assert timer.seconds["generate"] >= 0.06
    assert timer.seconds["reward"] < 0.03
    metrics = timer.metrics(0.12)
    assert set(metrics) == {f"timing/{p}" for p in PHASES} | {f"timing/{p}_share" for p in PHASES}
    assert metrics["timing/generate"] == timer.seconds["generate"]
    assert metrics["timing/generate_share"] == pytest.approx(timer.seconds["generate"] / 0.12)
    assert metrics["timing/update"] == 0.0


def test_a_phase_that_raises_still_counts():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError), timer("update"):
        time.sleep(0.02)
        raise RuntimeError("stopped")
    assert timer.seconds["update"] >= 0.02


def test_a_phase_outside_the_named_ones_starts_from_zero():
    timer = PhaseTimer()
    with timer("sync"):
        pass
    assert 0.0 <= timer.seconds["sync"] < 0.03 and "timing/sync" in timer.metrics(1.0)
