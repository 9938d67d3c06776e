"""A verdict per task from the paired intervals of GRPO − SFT: *improved*, *traded*, *no change* or *worse*.

A mean reward can rise while one kind of item gets worse: saying "unknown" everywhere gains on the
ambiguous items and loses on the disambiguated ones. So the outcome of a task is judged over every
metric of that task that has a wanted direction (``ROWS``: each kind's accuracy, and |s_AMB|, exact
match, F1, over-abstention, the hallucination rate), each read from its 95 % paired-bootstrap interval
(``compare.paired_bootstrap``): *better* when the interval lies wholly on the wanted side of 0, *worse*
when it lies wholly on the other, otherwise within noise.

| better beyond noise | worse beyond noise | verdict   |
| ------------------- | ------------------ | --------- |
| some                | none               | improved  |
| some                | some               | traded    |
| none                | none               | no change |
| none                | some               | worse     |

A trade is reported as one, whatever the headline reward says, and names both sides. ``verdicts`` is a
pure function of the comparison report (``eval_compare.json``'s ``grpo_minus_sft``); the markdown
sections (``verdict_markdown``, ``kinds_markdown``) open ``reports/eval.md`` and ``reports/bias.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from grpo.data.schema import TASKS


class Row(NamedTuple):
    """One metric of one kind of item, with the direction in which it should move."""

    task: str
    kind: str
    """The kind of item it is measured on (``grpo/data/kinds.py``), or ``all items``."""
    metric: str
    """Its key in ``eval.json`` and in the intervals (``compare.INTERVAL_METRICS``)."""
    label: str
    """Its name in the by-kind table (beside the kind)."""
    short: str
    """Its name in the verdict table and summaries (kind included)."""
    wanted: int
    """+1: should rise; -1: should fall."""


ROWS = (
    Row("fairness", "ambiguous", "fairness/accuracy_ambig", "accuracy", "ambiguous acc", 1),
    Row("fairness", "ambiguous", "fairness/abs_s_amb", "|s_AMB|", "|s_AMB|", -1),
    Row("fairness", "disambiguated", "fairness/accuracy_disambig", "accuracy", "disambig. acc", 1),
    Row("hallucination", "answerable", "hallucination/accuracy_answerable", "accuracy", "answerable acc", 1),
    Row("hallucination", "answerable", "hallucination/exact_match", "exact match", "EM", 1),
    Row("hallucination", "answerable", "hallucination/f1", "F1", "F1", 1),
    Row(
        "hallucination",
        "answerable",
        "hallucination/over_abstention_rate",
        "over-abstention",
        "over-abstention",
        -1,
    ),
    Row(
        "hallucination",
        "unanswerable",
        "hallucination/accuracy_unanswerable",
        "accuracy (abstains)",
        "unanswerable acc",
        1,
    ),
    Row(
        "hallucination",
        "all items",
        "hallucination/hallucination_rate",
        "hallucination rate",
        "halluc. rate",
        -1,
    ),
)
"""Every metric a verdict reads, kind by kind: the rows of the by-kind table, in its order."""

WANTED = {row.metric: row.wanted for row in ROWS}
"""Metric -> the sign of an improvement (+1 up, -1 down)."""

VERDICTS = ("improved", "traded", "no change", "worse")
"""The outcomes, from best to worst."""


class Verdict(NamedTuple):
    """The outcome of one task under one decoding."""

    verdict: str
    """One of ``VERDICTS``."""
    better: list[str]
    """Metrics better beyond noise (``ROWS`` order)."""
    worse: list[str]
    """Metrics worse beyond noise (``ROWS`` order)."""
    summary: str
    """One line: the verdict and every metric beyond noise with its difference and interval."""


def beyond_noise(interval: Mapping[str, float | None], wanted: int) -> int:
    """+1 when the 95 % interval of a difference lies wholly on the ``wanted`` side of 0, -1 when wholly on
    the other, 0 when it holds 0 or is not measured (``low``/``high`` None)."""
    low, high = interval.get("low"), interval.get("high")
    if low is None or high is None:
        return 0
    if low > 0 or high < 0:
        return 1 if (low > 0) == (wanted > 0) else -1
    return 0


def _described(row: Row, interval: Mapping[str, float | None]) -> str:
    return f"{row.short} {interval['diff']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"


def task_verdict(task: str, intervals: Mapping[str, Mapping[str, float | None]]) -> Verdict | None:
    """The verdict of ``task`` from ``{metric: {"diff", "low", "high"}}``; None when none of its metrics was
    measured (no item of that task was evaluated)."""
    rows = [row for row in ROWS if row.task == task and intervals.get(row.metric, {}).get("low") is not None]
    if not rows:
        return None
    moved = {row: beyond_noise(intervals[row.metric], row.wanted) for row in rows}
    better = [row for row in rows if moved[row] > 0]
    worse = [row for row in rows if moved[row] < 0]
    verdict = {
        (True, False): "improved",
        (True, True): "traded",
        (False, False): "no change",
        (False, True): "worse",
    }[(bool(better), bool(worse))]
    parts = [
        f"{side} " + ", ".join(_described(r, intervals[r.metric]) for r in named)
        for side, named in (("better", better), ("worse", worse))
        if named
    ]
    summary = f"{task} {verdict}: " + ("; ".join(parts) if parts else "no metric moved beyond noise")
    return Verdict(verdict, [r.metric for r in better], [r.metric for r in worse], summary)


def verdicts(grpo_minus_sft: Mapping[str, Mapping[str, Mapping]] | None) -> dict[str, dict[str, dict]]:
    """``{mode: {task: {"verdict", "better", "worse", "summary"}}}`` of a comparison report's
    ``grpo_minus_sft`` (``{mode: {metric: {diff, low, high}}}``); empty when there is none."""
    out: dict[str, dict[str, dict]] = {}
    for mode, intervals in (grpo_minus_sft or {}).items():
        judged = {task: task_verdict(task, intervals) for task in TASKS}
        out[mode] = {task: verdict._asdict() for task, verdict in judged.items() if verdict is not None}
    return out


# --------------------------------------------------------------------------- report sections


def _md(text: str) -> str:
    """``text`` in a markdown table cell (``|s_AMB|``'s bars escaped)."""
    return text.replace("|", "\\|")


def _names(metrics: list[str]) -> str:
    short = {row.metric: row.short for row in ROWS}
    return _md(", ".join(short[m] for m in metrics)) or "—"


def verdict_markdown(judged: Mapping[str, Mapping[str, Mapping]], missing: str | None = None) -> list[str]:
    """``## verdict``: one line per decoding and task (names only: every number is in the by-kind table).
    ``missing``: why there is no verdict (GRPO or SFT not evaluated)."""
    lines = [
        "## verdict",
        "",
        "GRPO − SFT per task from the 95 % paired-bootstrap interval of every metric with a wanted "
        "direction:",
        "*improved* (some better beyond noise, none worse), *traded* (better and worse), *no change*, *worse*.",
        "",
    ]
    if not judged:
        return [*lines, f"No verdict: {missing or 'nothing was compared'}."]
    lines += [
        "| decoding | task | verdict | better beyond noise | worse beyond noise |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, tasks in judged.items():
        for task, verdict in tasks.items():
            lines.append(
                f"| {mode} | {task} | **{verdict['verdict']}** | {_names(verdict['better'])} | "
                f"{_names(verdict['worse'])} |"
            )
    return lines


def level(metrics: Mapping[str, Any], metric: str) -> float | None:
    """The value of a ``ROWS`` metric in one model's flat metrics (|s_AMB| from ``fairness/s_amb``)."""
    if metric == "fairness/abs_s_amb":
        value = metrics.get("fairness/s_amb")
        return None if value is None else abs(value)
    return metrics.get(metric)


def _cell(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def kinds_markdown(
    results: Mapping[str, Mapping[str, Mapping[str, Any]]],
    intervals: Mapping[str, Mapping[str, Mapping]] | None,
    modes: list[str],
) -> list[str]:
    """``## by kind of item``: every ``ROWS`` metric measured, per decoding: SFT, GRPO, GRPO − SFT, its 95 %
    interval and whether it moved beyond noise. ``results``: ``{model: {mode: flat metrics}}``."""
    lines = [
        "## by kind of item",
        "",
        "| decoding | task | kind | metric | SFT | GRPO | GRPO − SFT | 95 % CI | beyond noise |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | :---: | --- |",
    ]
    for mode in modes:
        sft, grpo = (results.get(name, {}).get(mode, {}) for name in ("sft", "grpo"))
        for row in ROWS:
            values = level(sft, row.metric), level(grpo, row.metric)
            if values == (None, None):
                continue
            interval = (intervals or {}).get(mode, {}).get(row.metric, {})
            low, high = interval.get("low"), interval.get("high")
            span = "—" if low is None else f"[{low:+.3f}, {high:+.3f}]"
            moved = {1: "better", -1: "worse", 0: ""}[beyond_noise(interval, row.wanted)]
            lines.append(
                f"| {mode} | {row.task} | {row.kind} | {_md(row.label)} | {_cell(values[0])} | {_cell(values[1])} | "
                f"{_cell(interval.get('diff'), signed=True)} | {span} | {moved} |"
            )
    return lines
