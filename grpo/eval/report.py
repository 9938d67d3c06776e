"""``eval.md``: the evaluation's results as one Markdown page.

The verdict per task and every kind of item's row come first (``grpo/eval/verdict.py``), then the setup,
the headline against the baselines and the GRPO − SFT intervals (``grpo/eval/compare.py``), and one table
per decoding mode: a row per metric, a column per model (base / SFT / GRPO) and the deltas GRPO − SFT
and SFT − base.
"""

from __future__ import annotations

from typing import Any

from grpo import paths
from grpo.config import Config
from grpo.eval.compare import decoded_modes, headline_markdown, intervals_markdown
from grpo.eval.verdict import kinds_markdown, verdict_markdown, verdicts

LABELS = {"base": "base", "sft": "SFT", "grpo": "GRPO"}
"""How the report names each of ``paths.MODELS``."""


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{float(value):.3f}"


def _delta(results: dict, mode: str, key: str, new: str, old: str) -> str:
    a, b = (results.get(name, {}).get(mode, {}).get(key) for name in (new, old))
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return "—"
    return f"{a - b:+d}" if isinstance(a, int) and isinstance(b, int) else f"{a - b:+.3f}"


def markdown_report(
    results: dict[str, dict],
    skipped: dict[str, str],
    n_records: int,
    cfg: Config,
    compare: dict | None = None,
) -> str:
    """Markdown: the verdict per task and every kind of item's row (``grpo/eval/verdict.py``), then the
    setup, the headline against the baselines, GRPO − SFT intervals, and one table per decoding mode
    (rows = metrics, columns base / SFT / GRPO and deltas)."""
    intervals = None if compare is None else compare["grpo_minus_sft"]
    missing = ", ".join(f"{LABELS[n]} skipped ({skipped[n]})" for n in ("sft", "grpo") if n in skipped)
    lines = [
        "# Evaluation",
        "",
        *verdict_markdown(verdicts(intervals), missing or None),
        "",
        *kinds_markdown(results, intervals, decoded_modes(results)),
        "",
        *_setup(skipped, n_records, cfg),
    ]
    if compare is not None:
        lines += ["", *headline_markdown(results, compare["baselines"], LABELS)]
        if compare["grpo_minus_sft"] is not None:
            lines += ["", *intervals_markdown(compare["grpo_minus_sft"], cfg.eval.bootstrap)]
    for mode in decoded_modes(results):
        lines += ["", *_mode_table(results, mode)]
    return "\n".join(lines) + "\n"


def _setup(skipped: dict[str, str], n_records: int, cfg: Config) -> list[str]:
    """The ``## setup`` section: the records, the decodings, and each model skipped with why."""
    sampling, group = cfg.grpo.sampling, cfg.eval.samples_per_prompt
    decoding = (
        f"greedy decoding, and {group} samples per prompt at temperature {sampling.temperature}"
        if group
        else "greedy decoding only (`eval.samples_per_prompt: 0`)"
    )
    return [
        "## setup",
        "",
        f"{n_records} eval records from `{paths.data_file(cfg, 'eval')}` (seed {cfg.seed}); {decoding}. "
        "`—`: not measured (no item of that kind) or model absent.",
        "",
        *(f"- {LABELS[name]} skipped: {reason}" for name, reason in skipped.items()),
    ]


def _mode_table(results: dict[str, dict], mode: str) -> list[str]:
    """The ``## <mode>`` table: every metric any model has in ``mode``, each model's value and the deltas."""
    header = [*(LABELS[name] for name in paths.MODELS), "GRPO − SFT", "SFT − base"]
    keys = list(dict.fromkeys(k for name in paths.MODELS for k in results.get(name, {}).get(mode, {})))
    lines = [f"## {mode}", "", "| metric | " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(header)]
    for key in keys:
        cells = [_cell(results[name][mode].get(key)) if name in results else "—" for name in paths.MODELS]
        cells += [_delta(results, mode, key, "grpo", "sft"), _delta(results, mode, key, "sft", "base")]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines
