"""``grpo bias --bbq DIR``: the models of a run on published BBQ items, with their real stereotypes.

The project's fairness data are generated: made-up groups whose "stereotype" the SFT noise plants
(``data.sft_noise``). A pretrained model brings real stereotypes of its own, which BBQ (Parrish et al.
2022, arXiv 2110.08193; CC BY 4.0) measures. Give ``--bbq`` a folder of BBQ's category files (``data/*.jsonl``
of the public repository ``nyu-mll/BBQ``; any subset of the categories). From each category
``--per-category`` items are drawn, in equal shares of context condition (ambiguous, disambiguated)
and question polarity, and rendered by the one renderer as the run's fairness prompts (its
``data.fairness_answer``). Every model of the run
(base, SFT, GRPO: lineage-checked as ``grpo evaluate`` checks them) answers each greedily; the answers
are parsed and counted as the evaluation stage counts them (``eval.metrics.bias_scores``).

Outputs: ``<metrics_dir>/bias.json`` (per model: BBQ accuracy and bias scores overall and per category;
paired bootstrap 95 % intervals of GRPO − SFT and GRPO − base; the verdict of GRPO − SFT on BBQ,
``grpo/eval/verdict.py``) and ``<reports_dir>/bias.md``, which opens with that verdict and each kind's rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo import paths
from grpo.config import Config
from grpo.data.bbq import load_bbq
from grpo.data.schema import make_record
from grpo.data.splits import stratified_sample
from grpo.eval.compare import item_outcomes, paired_bootstrap
from grpo.eval.evaluate import evaluate
from grpo.eval.report import LABELS
from grpo.eval.verdict import kinds_markdown, verdict_markdown, verdicts
from grpo.files import write_atomically
from grpo.locks import writes

STRATA = {
    (condition, polarity): 0.25 for condition in ("ambig", "disambig") for polarity in ("neg", "nonneg")
}
"""Each category's items: a quarter per (context condition, question polarity)."""
SHOWN = ("accuracy_ambig", "accuracy_disambig", "s_amb", "s_dis")
"""The BBQ figures the report's tables show (``bias_scores``' keys)."""
INTERVALS = ("fairness/accuracy_ambig", "fairness/accuracy_disambig", "fairness/abs_s_amb")
"""The differences that get a paired bootstrap interval."""
SFT_DIFFERENCE = "GRPO − SFT"
"""The difference the verdict reads."""


def bbq_records(
    folder: Path, per_category: int, seed: int, answer_format: str = "letter"
) -> list[dict[str, Any]]:
    """``per_category`` BBQ items of each category file under ``folder`` (all of a smaller category), as
    eval records asking for the option as ``answer_format`` says (``data.fairness_answer``), drawn by
    ``seed`` in equal shares of ``STRATA``."""
    loaded = load_bbq(folder, 0.5, seed)  # the split is the loader's; every item is eligible here
    by_category: dict[str, list[dict[str, Any]]] = {}
    for item in loaded.pools["train"] + loaded.pools["eval"]:
        by_category.setdefault(item["category"], []).append(item)
    rng = random.Random(f"bias:{seed}")
    records = []
    for category in sorted(by_category):
        pool = by_category[category]
        chosen = stratified_sample(
            pool,
            min(per_category, len(pool)),
            lambda item: (item["context_condition"], item["question_polarity"]),
            STRATA,
            rng,
        )
        records += [
            make_record(fields | {"answer_format": answer_format}, "eval").model_dump(mode="json")
            for fields in chosen
        ]
    return records


def fairness_figures(metrics: dict[str, Any], prefix: str = "fairness/") -> dict[str, Any]:
    """``SHOWN`` of one model's flat greedy metrics (``prefix``: overall, or one category's)."""
    return {key: metrics.get(prefix + key) for key in SHOWN}


def model_figures(greedy: dict[str, Any], categories: Sequence[str]) -> dict[str, Any]:
    """One model's ``SHOWN`` figures from its flat greedy metrics: ``overall`` and ``by_category``."""
    return {
        "overall": fairness_figures(greedy),
        "by_category": {c: fairness_figures(greedy, f"fairness/by_category/{c}/") for c in categories},
    }


def intervals(texts: dict[str, dict], records: Sequence[dict], cfg: Config) -> dict[str, dict]:
    """``{"GRPO − SFT": {metric: {diff, low, high}}, "GRPO − base": ...}`` where both models answered."""
    outcomes = {name: item_outcomes(got["greedy"], records, cfg.rewards) for name, got in texts.items()}
    out = {}
    for old in ("sft", "base"):
        if "grpo" in outcomes and old in outcomes:
            both = paired_bootstrap(outcomes["grpo"], outcomes[old], cfg.eval.bootstrap, cfg.seed)
            out[f"GRPO − {LABELS[old]}"] = {key: both[key] for key in INTERVALS}
    return out


def _cell(value: Any) -> str:
    return "—" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def sft_verdicts(differences: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """The verdict of GRPO − SFT on BBQ (``grpo/eval/verdict.py``, greedy, the fairness task); empty without
    both models."""
    return verdicts({"greedy": differences[SFT_DIFFERENCE]} if SFT_DIFFERENCE in differences else None)


def report(
    results: dict[str, dict],
    differences: dict[str, dict],
    records: Sequence[dict],
    folder: Path,
    cfg: Config,
    flat: dict[str, dict] | None = None,
) -> str:
    """``bias.md``: the verdict and the rows of each kind of item (``flat``: each model's flat metrics,
    ``{model: {"greedy": {...}}}``), the overall figures per model, |s_AMB| per category, the intervals."""
    names = list(results)
    categories = sorted({r["category"] for r in records})
    intervals = {"greedy": differences[SFT_DIFFERENCE]} if SFT_DIFFERENCE in differences else None
    lines = [
        "# Bias on BBQ",
        "",
        *verdict_markdown(sft_verdicts(differences), "GRPO or SFT is absent from the run"),
        "",
        *kinds_markdown(flat or {}, intervals, ["greedy"]),
        "",
        "## figures per model",
        "",
        f"{len(records)} BBQ items from `{folder}` ({', '.join(categories)}), greedy, seed {cfg.seed}. "
        "s_AMB / s_DIS in [-1, 1]: 1 = always the stereotyped answer, 0 = no lean.",
        "",
        *_table("metric", names, {key: [results[n]["overall"][key] for n in names] for key in SHOWN}),
        "",
        "## s_AMB per category",
        "",
        *_table(
            "category", names, {c: [results[n]["by_category"][c]["s_amb"] for n in names] for c in categories}
        ),
    ]
    for label, diffs in differences.items():
        lines += ["", *_interval_table(label, diffs, cfg.eval.bootstrap)]
    return "\n".join(lines) + "\n"


def _table(first: str, names: list[str], rows: dict[str, list[Any]]) -> list[str]:
    """A Markdown table: ``first`` then a column per model of ``names``; a row per key of ``rows``."""
    lines = [f"| {first} | " + " | ".join(LABELS[n] for n in names) + " |", "| --- |" + " ---: |" * len(names)]
    return lines + [f"| {key} | " + " | ".join(_cell(v) for v in values) + " |" for key, values in rows.items()]


def _interval_table(label: str, diffs: dict[str, dict], resamples: int) -> list[str]:
    """One comparison's differences with their paired-bootstrap intervals."""
    lines = [
        f"## {label}, 95 % paired bootstrap ({resamples} resamples)",
        "",
        "| metric | difference | interval |",
        "| --- | ---: | --- |",
    ]
    for key, value in diffs.items():
        low, high = value["low"], value["high"]
        span = "—" if low is None else f"[{low:+.3f}, {high:+.3f}]"
        lines.append(f"| {key} | {_cell(value['diff'])} | {span} |")
    return lines


@writes(lambda cfg: cfg.paths.metrics_dir)
def run(cfg: Config, bbq: Path, per_category: int = 100) -> int:
    """``grpo bias --bbq DIR``: write bias.json and bias.md for the run's models."""
    folder = Path(bbq)
    records = bbq_records(folder, per_category, cfg.seed, cfg.data.fairness_answer)
    greedy = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"samples_per_prompt": 0})})
    texts: dict[str, dict] = {}
    flat, _ = evaluate(greedy, records, texts=texts)
    categories = sorted({r["category"] for r in records})
    results = {name: model_figures(metrics["greedy"], categories) for name, metrics in flat.items()}
    differences = intervals(texts, records, cfg)
    out, md = paths.metrics_file(cfg, "bias"), paths.report_file(cfg, "bias.md")
    judged = sft_verdicts(differences)
    summary = {
        "bbq": str(folder),
        "items": len(records),
        "models": results,
        "intervals": differences,
        "verdicts": judged,
    }
    write_atomically(
        {
            out: json.dumps(summary, indent=2) + "\n",
            md: report(results, differences, records, folder, cfg, flat),
        }
    )
    for tasks in judged.values():
        for verdict in tasks.values():
            print(f"bias: BBQ, greedy: {verdict['summary']}")
    print(f"bias: {len(records)} BBQ items, {', '.join(LABELS[n] for n in results)} -> {out}, {md}")
    return 0
