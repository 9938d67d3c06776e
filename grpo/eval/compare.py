"""What "better" means on the eval split: reference baselines and paired bootstrap intervals.

The headline number is the mean reward over the eval items (``reward``, both tasks, the training
reward itself). A policy that abstains everywhere ("I don't know." on grounded QA, the "unknown"
option on fairness) earns +1 on the items where abstaining is right and -0.5 on the others: 0.25 on
a balanced split. A trained model is better than that only by answering the answerable items
correctly, so abstaining on everything cannot win the headline.

Baselines (``BASELINES``) are scored by the same parser and metrics as the models:

- ``abstain``: "I don't know." on every grounded question, the "unknown" option on every fairness item;
- ``random``: a uniformly random option on fairness; on grounded QA a fair coin between abstaining
  and the item's distractor (a confident answer of the right type, never the right one).

Differences between two models (``GRPO − SFT``) come with a 95 % percentile interval from a paired
bootstrap over eval items: items are resampled with replacement within each task (so the task mix is
fixed), both models are scored on the same resample, and a sampled item keeps all its samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from grpo.data.schema import ABSTENTION, LETTERS
from grpo.eval.metrics import FairnessItem, HallucinationItem, bias_scores, hallucination_metrics, mean
from grpo.rewards import fairness_outcome, hallucination_outcome, weighted_reward

HEADLINE = "reward"
"""The report's headline: mean reward over eval items (abstaining everywhere scores 0.25 on a balanced split)."""

INTERVAL_METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "reward": lambda m: m["reward"],
    "fairness/accuracy_ambig": lambda m: m["fairness"]["accuracy_ambig"],
    "fairness/accuracy_disambig": lambda m: m["fairness"]["accuracy_disambig"],
    "fairness/abs_s_amb": lambda m: None if m["fairness"]["s_amb"] is None else abs(m["fairness"]["s_amb"]),
    "hallucination/hallucination_rate": lambda m: m["hallucination"]["hallucination_rate"],
    "hallucination/exact_match": lambda m: m["hallucination"]["exact_match"],
    "hallucination/f1": lambda m: m["hallucination"]["f1"],
    "hallucination/over_abstention_rate": lambda m: m["hallucination"]["over_abstention_rate"],
    "hallucination/accuracy_answerable": lambda m: m["hallucination"]["accuracy_answerable"],
    "hallucination/accuracy_unanswerable": lambda m: m["hallucination"]["accuracy_unanswerable"],
}
"""The metrics whose GRPO − SFT difference gets a bootstrap interval (key -> how to read it)."""

HALLUCINATION_READ = (
    "hallucination_rate",
    "exact_match",
    "f1",
    "over_abstention_rate",
    "accuracy_answerable",
    "accuracy_unanswerable",
)
"""The grounded-QA figures ``INTERVAL_METRICS`` reads (``None`` where a resample has no grounded item)."""

MODES = ("greedy", "sampled")
"""The decodings evaluation scores: greedy, and ``eval.samples_per_prompt`` samples (none when 0)."""

BASELINES = ("abstain", "random")
BASELINE_LABELS = {"abstain": 'always abstain / "unknown"', "random": "random choice"}


class ItemOutcomes(NamedTuple):
    """Per-item outcomes of one model: ``units[i]`` holds the scored samples of eval record ``i``."""

    tasks: list[str]
    units: list[list[tuple[FairnessItem | HallucinationItem, float]]]


def fairness_item(text: str, record: dict) -> FairnessItem:
    return FairnessItem(
        category=str(record.get("category", "all")),
        context_condition=record["context_condition"],
        question_polarity=record["question_polarity"],
        label=int(record["label"]),
        unknown_idx=int(record["unknown_idx"]),
        target_idx=int(record["target_idx"]),
        choice=fairness_outcome(text, record).choice,
    )


def hallucination_item(text: str, record: dict) -> HallucinationItem:
    outcome = hallucination_outcome(text, record)
    return HallucinationItem(
        bool(record["answerable"]), outcome.abstained, float(outcome.em), outcome.f1, question_kind(record)
    )


def question_kind(record: dict) -> str:
    """A grounded record's kind of question: its ``template_id`` without the task's prefix
    (``company.year``, ``squad2.Normans``); ``all`` where the record has none."""
    return str(record.get("template_id") or "all").removeprefix("hallucination.")


def item_outcomes(texts: Sequence[str], records: Sequence[dict], rewards: Any) -> ItemOutcomes:
    """Score ``texts`` (``k`` per record, record-major) once; resampling then only counts. ``rewards``: the
    params section (or the weights alone), as ``weighted_reward`` takes it."""
    if not records or len(texts) % len(records):
        raise ValueError(f"item_outcomes: {len(texts)} texts for {len(records)} records; expected a multiple")
    k = len(texts) // len(records)
    units = []
    for index, record in enumerate(records):
        item = fairness_item if record["task"] == "fairness" else hallucination_item
        units.append(
            [
                (item(text, record), weighted_reward(record["task"], text, record, rewards))
                for text in texts[index * k : (index + 1) * k]
            ]
        )
    return ItemOutcomes([record["task"] for record in records], units)


def summary(outcomes: ItemOutcomes, indices: Sequence[int]) -> dict[str, Any]:
    """Headline reward and the task metrics of the records at ``indices`` (repeats allowed)."""
    pairs = [pair for i in indices for pair in outcomes.units[i]]
    fair = [item for item, _ in pairs if isinstance(item, FairnessItem)]
    hall = [item for item, _ in pairs if isinstance(item, HallucinationItem)]
    return {
        "reward": mean(reward for _, reward in pairs),
        "fairness": bias_scores(fair)
        if fair
        else {"accuracy_ambig": None, "accuracy_disambig": None, "s_amb": None},
        "hallucination": hallucination_metrics(hall, by_kind=False)
        if hall
        else dict.fromkeys(HALLUCINATION_READ),
    }


def _resample(by_task: dict[str, list[int]], rng: random.Random) -> list[int]:
    return [rng.choice(indices) for indices in by_task.values() for _ in indices]


def paired_bootstrap(
    new: ItemOutcomes, old: ItemOutcomes, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, dict[str, float | None]]:
    """``{metric: {"diff", "low", "high"}}`` of ``new − old`` over ``INTERVAL_METRICS``.

    ``diff`` is the difference on the full eval set; ``low``/``high`` the percentile interval of the
    difference over ``n_boot`` paired resamples (None where a metric is undefined).
    """
    if new.tasks != old.tasks:
        raise ValueError("paired_bootstrap: the two models were scored on different eval records")
    by_task: dict[str, list[int]] = {}
    for index, task in enumerate(new.tasks):
        by_task.setdefault(task, []).append(index)
    every = list(range(len(new.tasks)))
    point = {
        key: _diff(read, summary(new, every), summary(old, every)) for key, read in INTERVAL_METRICS.items()
    }
    draws: dict[str, list[float]] = {key: [] for key in INTERVAL_METRICS}
    rng = random.Random(f"bootstrap:{seed}")
    for _ in range(n_boot):
        indices = _resample(by_task, rng)
        a, b = summary(new, indices), summary(old, indices)
        for key, read in INTERVAL_METRICS.items():
            value = _diff(read, a, b)
            if value is not None:
                draws[key].append(value)
    tail = (1 - level) / 2
    return {key: {"diff": point[key], **_percentiles(draws[key], tail)} for key in INTERVAL_METRICS}


def _diff(read: Callable[[dict[str, Any]], float | None], a: dict, b: dict) -> float | None:
    x, y = read(a), read(b)
    return None if x is None or y is None else x - y


def _percentiles(values: list[float], tail: float) -> dict[str, float | None]:
    if not values:
        return {"low": None, "high": None}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {"low": ordered[round(tail * last)], "high": ordered[round((1 - tail) * last)]}


def baseline_texts(name: str, records: Sequence[dict], seed: int) -> list[str]:
    """One reply per record from the baseline policy ``name`` (see the module docstring)."""
    rng = random.Random(f"baseline:{name}:{seed}")
    texts = []
    for record in records:
        if record["task"] == "fairness":
            choice = int(record["unknown_idx"]) if name == "abstain" else rng.randrange(len(LETTERS))
            texts.append(f"Answer: {LETTERS[choice]}")
        elif name == "abstain" or not record.get("distractor"):
            texts.append(ABSTENTION)
        else:
            texts.append(rng.choice([ABSTENTION, record["distractor"]]))
    return texts


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def decoded_modes(results: dict[str, dict]) -> list[str]:
    """The decodings (of ``MODES``) that any model of ``results`` (``{model: {mode: metrics}}``) was scored in."""
    return [mode for mode in MODES if any(mode in modes for modes in results.values())]


def headline_markdown(
    results: dict[str, dict], baselines: dict[str, dict], labels: dict[str, str]
) -> list[str]:
    """The headline table: mean reward of each model (per decoding) and of each baseline."""
    modes = decoded_modes(results)
    lines = [
        "## headline: mean reward on eval items",
        "",
        "Abstaining everywhere earns +1 where abstaining is right and `rewards.abstain_when_answered` (−0.5 "
        "by default) elsewhere: a model beats it only by answering the answerable items right.",
        "",
        "| policy | " + " | ".join(modes) + " |",
        "| --- |" + " ---: |" * len(modes),
    ]
    for name, scored in results.items():
        cells = [_fmt(scored.get(mode, {}).get(HEADLINE)) for mode in modes]
        lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
    for name, metrics in baselines.items():  # a baseline's reply is fixed: one column, the greedy one
        cells = [_fmt(metrics.get(HEADLINE)), *("—" for _ in modes[1:])]
        lines.append(f"| baseline: {BASELINE_LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


def intervals_markdown(intervals: dict[str, dict[str, dict]], n_boot: int) -> list[str]:
    """``GRPO − SFT`` per metric and decoding mode, with its 95 % paired-bootstrap interval."""
    lines = [
        "## GRPO − SFT, 95 % bootstrap intervals",
        "",
        f"Paired bootstrap over eval items ({n_boot} resamples, within each task). "
        "An interval that excludes 0 is a difference beyond item noise.",
        "",
        "| metric | " + " | ".join(f"{mode} Δ | {mode} 95 % CI" for mode in intervals) + " |",
        "| --- |" + " ---: | :---: |" * len(intervals),
    ]
    for key in INTERVAL_METRICS:
        cells = []
        for mode in intervals:
            row = intervals[mode][key]
            low, high = row["low"], row["high"]
            cells += [_fmt(row["diff"], signed=True), "—" if low is None else f"[{low:+.3f}, {high:+.3f}]"]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines
