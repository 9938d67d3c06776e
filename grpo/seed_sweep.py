"""``grpo seeds``: the whole pipeline once per seed, then one table of GRPO − SFT across seeds.

Each seed runs every stage (``grpo pipeline``) with ``seed`` set and every output folder under
``<runs_dir>/seeds/seed-<n>/`` (data, models, metrics, reports, runs), so seeds never share or
overwrite an artifact and the default outputs are untouched. The table (printed and written to
``<reports_dir>/seeds.md``) counts each task's verdict over the seeds (``grpo/eval/verdict.py``) and shows,
per seed, each task's verdict, the headline reward of SFT and GRPO and the GRPO − SFT difference of the
key metrics with their 95 % paired-bootstrap intervals (``grpo/eval/compare.py``),
and a last row that says in how many seeds each difference went the wanted way beyond noise: once
for greedy replies, once for sampled ones (the policy GRPO trains) when evaluation sampled any.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo import pipeline
from grpo.config import Config
from grpo.data.schema import TASKS
from grpo.eval.compare import MODES
from grpo.eval.verdict import VERDICTS, WANTED, beyond_noise
from grpo.files import write_text

COLUMNS: dict[str, int] = {
    "reward": 1,
    **{
        key: WANTED[key]
        for key in (
            "fairness/accuracy_ambig",
            "fairness/abs_s_amb",
            "fairness/accuracy_disambig",
            "hallucination/hallucination_rate",
            "hallucination/exact_match",
            "hallucination/over_abstention_rate",
        )
    },
}
"""The GRPO − SFT differences the table shows, and the sign of an improvement (+1 up, -1 down)."""


def seed_config(cfg: Config, seed: int) -> Config:
    """``cfg`` with ``seed`` and every output folder under ``<runs_dir>/seeds/seed-<seed>``."""
    root = Path(cfg.paths.runs_dir) / "seeds" / f"seed-{seed}"
    paths = cfg.paths.model_copy(
        update={
            name: str(root / Path(getattr(cfg.paths, name)).name)
            for name in ("data_dir", "models_dir", "metrics_dir", "reports_dir", "runs_dir")
        }
    )
    return cfg.model_copy(update={"seed": seed, "paths": paths})


def seed_row(cfg: Config, mode: str = "greedy") -> dict[str, Any] | None:
    """The figures of one finished seed run under ``mode``'s decoding, read from its ``eval.json`` and
    ``eval_compare.json``; None when evaluation did not decode that way (``eval.samples_per_prompt: 0``)."""
    metrics = Path(cfg.paths.metrics_dir)
    results = json.loads((metrics / "eval.json").read_text())
    compare = json.loads((metrics / "eval_compare.json").read_text())
    diffs, sft, grpo = (
        compare["grpo_minus_sft"].get(mode),
        results["sft"].get(mode),
        results["grpo"].get(mode),
    )
    if not diffs or not sft or not grpo:
        return None
    return {
        "seed": cfg.seed,
        "sft_reward": sft["reward"],
        "grpo_reward": grpo["reward"],
        "abstain_reward": compare["baselines"]["abstain"]["reward"],
        "over_abstention_grpo": grpo["hallucination/over_abstention_rate"],
        "diffs": {key: diffs[key] for key in COLUMNS},
        "verdicts": {task: v["verdict"] for task, v in compare.get("verdicts", {}).get(mode, {}).items()},
    }


def _cell(row: dict[str, float | None]) -> str:
    if row["diff"] is None:
        return "—"
    interval = "" if row["low"] is None else f" [{row['low']:+.2f}, {row['high']:+.2f}]"
    return f"{row['diff']:+.3f}{interval}"


def improved(row: dict[str, float | None], sign: int) -> bool:
    """The difference goes the wanted way and its 95 % interval excludes 0."""
    return beyond_noise(row, sign) > 0


def verdict_counts(rows: list[dict[str, Any]]) -> str:
    """``fairness: improved 2/3, traded 1/3; hallucination: ...``: each task's verdicts counted over seeds."""
    parts = []
    for task in TASKS:
        seen = [row["verdicts"].get(task) for row in rows]
        counts = [f"{verdict} {seen.count(verdict)}/{len(rows)}" for verdict in VERDICTS if verdict in seen]
        if counts:
            parts.append(f"{task}: " + ", ".join(counts))
    return "; ".join(parts)


def seeds_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per seed (one decoding), then the count of seeds improved beyond noise."""
    head = [
        "seed",
        *(f"{task} verdict" for task in TASKS),
        "SFT reward",
        "GRPO reward",
        "abstain-all reward",
        "GRPO over-abstention",
        *(f"Δ {key}" for key in COLUMNS),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for row in rows:
        cells = [
            str(row["seed"]),
            *(row["verdicts"].get(task, "—") for task in TASKS),
            *(
                f"{row[k]:.3f}" if row[k] is not None else "—"
                for k in ("sft_reward", "grpo_reward", "abstain_reward", "over_abstention_grpo")
            ),
        ]
        cells += [_cell(row["diffs"][key]) for key in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    counts = [
        f"{sum(improved(row['diffs'][key], sign) for row in rows)}/{len(rows)}"
        for key, sign in COLUMNS.items()
    ]
    lines.append(
        "| improved beyond noise |" + " |" * (len(head) - len(COLUMNS) - 1) + " " + " | ".join(counts) + " |"
    )
    return f"Verdicts: {verdict_counts(rows)}.\n\n" + "\n".join(lines) + "\n"


def run(cfg: Config, seeds: Sequence[int] = (1, 2, 3)) -> int:
    """``grpo seeds --seeds 1 2 3``: the pipeline per seed, then the table (printed and in seeds.md)."""
    rows = []
    for seed in seeds:
        seeded = seed_config(cfg, seed)
        print(f"seeds: seed {seed} -> {Path(seeded.paths.runs_dir).parent}")
        code = pipeline.run(seeded)
        if code:
            print(f"seeds: seed {seed} stopped with exit code {code}; later seeds not run")
            return code
        rows.append({mode: seed_row(seeded, mode) for mode in MODES})
    report = seeds_report(rows, cfg)
    out = Path(cfg.paths.reports_dir) / "seeds.md"
    write_text(out, report)
    print(report + f"seeds: table written to {out}")
    return 0


def seeds_report(rows: list[dict[str, dict[str, Any] | None]], cfg: Config) -> str:
    """seeds.md: the greedy table, then the sampled one where every seed has sampled figures."""
    sampled = (
        f"Sampled replies ({cfg.eval.samples_per_prompt} per prompt at temperature "
        f"{cfg.grpo.sampling.temperature}, the policy GRPO trains)"
    )
    parts = ["# GRPO − SFT across seeds (95 % paired-bootstrap intervals)\n"]
    for mode, title in (("greedy", "Greedy replies"), ("sampled", sampled)):
        if rows and all(row[mode] is not None for row in rows):
            parts.append(f"## {title}\n\n" + seeds_table([row[mode] for row in rows]))
    return "\n".join(parts)
