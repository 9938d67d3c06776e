"""Per-kind reward and abstention every step, and the monitor rules that see a trade coming.

GRPO can raise its mean reward by saying "unknown" everywhere: it gains on the items whose context
cannot tell (ambiguous, unanswerable) and loses on those whose context answers (disambiguated,
answerable). The mean hides it; the kinds show it (``grpo/data/kinds.py``). Each step records, over the
first draw's rows of each kind present:

- ``kinds/<kind>/reward``: the mean reward;
- ``kinds/<kind>/abstention``: the share of replies that say "unknown" (fairness) or abstain (grounded QA).

Two monitor rules (params ``monitor.kind_trade``, ``monitor.abstention_rise``; warn by default) read
them over the last ``window`` steps, comparing the mean of the window's later half with that of its
earlier half (a trend, not a step's noise):

- ``kind_trade``: one kind's reward fell by at least ``threshold`` while another kind's rose by at least
  ``threshold``;
- ``abstention_rise``: the abstention rate on a kind whose context answers rose by at least ``threshold``;

each change also beyond noise (``NOISE_Z`` standard errors, from the spread of the per-step values).

A rule fires on the step its condition starts to hold (again), naming the kinds, both halves' means and
the steps; it needs ``window`` steps of history (a resumed run is primed with the history it restored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from grpo.core.advantages import per_row
from grpo.data.kinds import ALL_KINDS, ANSWERED_KINDS, record_kind
from grpo.rewards import fairness_outcome, hallucination_outcome

TRADE_RULES = ("kind_trade", "abstention_rise")
"""The monitor rules of this module (their keys under ``monitor`` in params)."""

TRADE_CAUSES = (
    'the reward pays too much for "unknown" / abstaining where the context answers (params '
    "rewards.abstain_when_answered): abstaining everywhere then beats reading the context",
    "the batch holds too few items whose context answers (params grpo.kind_share)",
    "a learning rate or step count that moves the policy faster than it learns to read (grpo.lr, grpo.steps)",
    "too weak a KL to the SFT policy (grpo.loss.beta)",
)


def reward_key(kind: str) -> str:
    return f"kinds/{kind}/reward"


def abstention_key(kind: str) -> str:
    return f"kinds/{kind}/abstention"


def count_key(kind: str) -> str:
    """The rows of ``kind`` in a process's first draw: the weight its kind metrics merge with."""
    return f"rows/{kind}"


KIND_MEANS = {key(kind): count_key(kind) for kind in ALL_KINDS for key in (reward_key, abstention_key)}
"""Per-kind metrics and the count each is a mean over (merged over processes like ``process_merge.PROCESS_MEANS``)."""


def abstains(text: str, record: Mapping[str, Any]) -> bool:
    """The reply says "unknown" (fairness: the unknown option) or abstains (grounded QA)."""
    if record["task"] == "fairness":
        return fairness_outcome(text, dict(record)).is_unknown
    return hallucination_outcome(text, dict(record)).abstained


def kind_stats(
    texts: Sequence[str], records: Sequence[Mapping[str, Any]], group_size: int, rewards: torch.Tensor
) -> dict[str, float]:
    """``kinds/<kind>/reward`` and ``kinds/<kind>/abstention`` over the rows of each kind present: row ``i``
    (``texts[i]``, ``rewards[i]``, ``[N]``) answers ``records[i // group_size]``."""
    rows = per_row(list(records), group_size)
    totals: dict[str, list[float]] = {}
    for text, record, reward in zip(texts, rows, rewards.tolist(), strict=True):
        total = totals.setdefault(record_kind(record), [0.0, 0.0, 0.0])
        total[0] += 1
        total[1] += reward
        total[2] += abstains(text, record)
    stats = {}
    for kind, (n, reward, abstained) in totals.items():
        stats[reward_key(kind)] = reward / n
        stats[abstention_key(kind)] = abstained / n
    return stats


def kind_counts(records: Sequence[Mapping[str, Any]], group_size: int) -> dict[str, float]:
    """``rows/<kind>``: rows of each kind among ``records``' ``group_size`` completions each."""
    counts: dict[str, float] = {}
    for record in records:
        key = count_key(record_kind(record))
        counts[key] = counts.get(key, 0.0) + group_size
    return counts


def progress(metrics: Mapping[str, Any]) -> str:
    """A short progress-bar field: each present kind's mean reward (``amb+0.4 dis-0.2 ans+0.8 una+0.1``)."""
    return " ".join(
        f"{kind[:3]}{float(metrics[reward_key(kind)]):+.1f}"
        for kind in ALL_KINDS
        if reward_key(kind) in metrics
    )


# --------------------------------------------------------------------------- trend rules


NOISE_Z = 2.0
"""A trend counts only where the change also exceeds this many standard errors of the difference of the
two halves' means (estimated from the spread of the per-step values): a small batch holds a few rows of
each kind, and their noise alone must not name a trade."""


class Move(NamedTuple):
    """How one kind's metric moved over a window: the earlier and the later half's means."""

    kind: str
    before: float
    after: float
    noise: float
    """Standard error of ``after - before``."""

    @property
    def change(self) -> float:
        return self.after - self.before

    def beyond(self, threshold: float, sign: int) -> bool:
        """Moved by at least ``threshold`` in the direction ``sign`` (+1 up, -1 down), and beyond noise."""
        return sign * self.change >= max(threshold, NOISE_Z * self.noise)

    def __str__(self) -> str:
        return f"{self.kind} {self.before:+.3f} -> {self.after:+.3f} ({self.change:+.3f}, noise ±{self.noise:.3f})"


def halves(history: Sequence[Mapping[str, Any]], key: str) -> tuple[float, float, float] | None:
    """``(earlier mean, later mean, standard error of their difference)`` of ``key`` over the two halves
    of ``history`` (steps lacking it skipped; an odd middle step counts in neither); None when a half
    has fewer than two values (no spread to measure its noise by)."""
    half = len(history) // 2
    parts = [
        [float(m[key]) for m in part if m.get(key) is not None]
        for part in (history[:half], history[len(history) - half :])
    ]
    if any(len(part) < 2 for part in parts):
        return None
    means = [sum(part) / len(part) for part in parts]
    variances = [
        sum((v - mean) ** 2 for v in part) / (len(part) - 1) / len(part)
        for part, mean in zip(parts, means, strict=True)
    ]
    return means[0], means[1], math.sqrt(sum(variances))


def _moves(
    history: Sequence[Mapping[str, Any]], kinds: Sequence[str], key: Callable[[str], str]
) -> list[Move]:
    """How ``key(kind)`` moved, for each kind measured in both halves (at least two steps each)."""
    found = {kind: halves(history, key(kind)) for kind in kinds}
    return [Move(kind, *values) for kind, values in found.items() if values is not None]


def kind_trade(history: Sequence[Mapping[str, Any]], threshold: float) -> tuple[bool, str]:
    """A kind's mean reward fell by >= ``threshold`` while another's rose by >= ``threshold``, both beyond
    noise."""
    moves = _moves(history, ALL_KINDS, reward_key)
    if len(moves) < 2:
        return False, "fewer than two kinds measured"
    fallen = min(moves, key=lambda m: m.change)
    risen = max(moves, key=lambda m: m.change)
    holds = fallen.beyond(threshold, -1) and risen.beyond(threshold, +1)
    return holds, f"reward of {fallen} while {risen}"


def abstention_rise(history: Sequence[Mapping[str, Any]], threshold: float) -> tuple[bool, str]:
    """The abstention rate of a kind whose context answers rose by >= ``threshold``, beyond noise."""
    moves = _moves(history, ANSWERED_KINDS, abstention_key)
    if not moves:
        return False, "no answered kind measured"
    risen = max(moves, key=lambda m: m.change)
    return risen.beyond(threshold, +1), f'"unknown"/abstention rate on {risen}'


TREND_RULES: dict[str, Callable[[Sequence[Mapping[str, Any]], float], tuple[bool, str]]] = {
    "kind_trade": kind_trade,
    "abstention_rise": abstention_rise,
}


class TrendWatch:
    """The trend rules over the last ``window`` steps of each; stateful, one per run.

    ``rules``: ``{name: RuleConfig}``. ``observe`` returns ``(rule, action, step, message, since)`` for each
    rule whose condition starts to hold at ``step`` (it held not at the step before).
    """

    def __init__(self, rules: Mapping[str, Any], history: Sequence[Mapping[str, Any]] = ()) -> None:
        self.rules = {name: cfg for name, cfg in rules.items() if cfg.action != "off"}
        self.history: list[Mapping[str, Any]] = [dict(h) for h in history]
        # A restored history: a condition that already held at its last step is not news after a resume.
        self.holding = {name: self._holds(name)[0] for name in self.rules}

    def _holds(self, name: str) -> tuple[bool, str]:
        window = self.rules[name].window
        if len(self.history) < window:
            return False, ""
        return TREND_RULES[name](self.history[-window:], self.rules[name].threshold)

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[tuple[str, str, int, str, int]]:
        self.history.append(dict(metrics, step=step))
        found = []
        for name, cfg in self.rules.items():
            holds, detail = self._holds(name)
            if holds and not self.holding[name]:
                since = int(self.history[-cfg.window]["step"])
                found.append(
                    (
                        name,
                        cfg.action,
                        step,
                        f"{detail}; later vs earlier half of steps {since}-{step}",
                        since,
                    )
                )
            self.holding[name] = holds
        longest = max((cfg.window for cfg in self.rules.values()), default=0)
        del self.history[: max(0, len(self.history) - longest)]
        return found
