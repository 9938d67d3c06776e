"""Wall-clock time per phase of a GRPO step, as ``timing/<phase>`` and ``timing/<phase>_share``.

The phases follow verl's ``timing_s/*``: ``generate`` (rollout), ``reward`` (reward functions and
advantages), ``reference`` (the stored reference and old log-probs) and ``update`` (the per-task
forwards, backwards, combination and optimizer step). A phase that runs more than once in a step
(dynamic resampling draws again) adds up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("generate", "reward", "reference", "update")


class PhaseTimer:
    """Accumulates seconds per phase: ``with timer("generate"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started

    def metrics(self, step_seconds: float) -> dict[str, float]:
        """``timing/<phase>`` seconds and ``timing/<phase>_share`` of the whole step's seconds."""
        out = {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()}
        out |= {
            f"timing/{phase}_share": seconds / max(step_seconds, 1e-9)
            for phase, seconds in self.seconds.items()
        }
        return out


@contextmanager
def untimed(phase: str) -> Iterator[None]:
    """The do-nothing timer, for callers that do not measure."""
    yield
