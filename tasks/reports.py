"""What the pre-flight and evaluation artifacts lead with, read from the reports the CLI wrote.

Nothing is computed here: the pre-flight's checks, values, bounds and units come from
``reports/preflight.json``, the evaluation's verdict from ``reports/eval.md``; this only lays them out
to be read at a glance (tasks/markdown.py: every row within 1,280 px), the full reports beside them.
"""

from __future__ import annotations

import re
from typing import Any

from tasks.markdown import CELL, LINE, table_cell

STATUS_WORDS = {"pass": "passed", "warn": "warning", "fail": "failed", "skip": "skipped"}
PREFLIGHT_COLUMNS = ("check", "invariant", "status", "value vs bound")
REASON_LINE = LINE
"""A check's reason is cut to one line of the artifact's box (the whole text is in the details)."""
VALUE_CELL = 24
"""The value-vs-bound cell's width, so that a row stays within ``markdown.ROW`` (the reasons, which would
not fit beside it, follow the table one line each)."""


def cut(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters (cut with ``…``)."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def short(text: str, width: int) -> str:
    """``text`` as a table cell (one line, pipes escaped), at most ``width`` characters (cut with ``…``)."""
    text = table_cell(text)
    return text if len(text) <= width else text[: width - 1].removesuffix("\\").rstrip() + "…"


def number(value: Any) -> str:
    """A value rounded for reading: floats to 3 significant digits, nothing else changed."""
    if isinstance(value, float):
        return f"{value:.3g}"
    return "—" if value is None else str(value)


def value_vs_bound(check: dict[str, Any]) -> str:
    """``4.77e-07 <= 0.0001 nats``, ``0.00046 > 1e-06 nats``, ``min_new_tokens=1 (bound: none)``."""
    value, bound, unit = check.get("value"), check.get("bound"), check.get("unit", "")
    if isinstance(value, dict):  # several numbers, each with its own bound: listed in the details
        return f"{len(value)} numbers (details)"
    if isinstance(value, list) or isinstance(bound, list | dict):
        listed = ", ".join(map(number, value)) if isinstance(value, list) else number(value)
        bounds = ", ".join(map(number, bound)) if isinstance(bound, list) else number(bound)
        return f"{listed or 'none'} vs {bounds or 'none'}"
    if isinstance(bound, str):  # an operator and a threshold, maybe the params key: "> 1e-06", ">= 0.5 (key)"
        relation = re.sub(r"\s*\(.*\)\s*$", "", bound)
    else:
        relation = f"<= {number(bound)}"
    return f"{number(value)} {relation} {unit}".strip()


def _reason(check: dict[str, Any]) -> str:
    """The hint when the check did not pass (what to try), else what was measured; its first clause."""
    text = (check.get("hint") if check.get("status") != "pass" else "") or check.get("detail", "")
    return text.split("; ", 1)[0]


def preflight_overall(checks: list[dict[str, Any]]) -> str:
    """``14 passed, 1 warning: sampling_processors`` (names for everything but passes)."""
    parts = []
    for status, word in STATUS_WORDS.items():
        names = [c["name"] for c in checks if c.get("status") == status]
        if not names:
            continue
        plural = "s" if status in ("warn",) and len(names) > 1 else ""
        parts.append(f"{len(names)} {word}{plural}" + ("" if status == "pass" else f": {', '.join(names)}"))
    return ", ".join(parts) or "no checks"


def preflight_markdown(report: dict[str, Any], details: str) -> str:
    """The pre-flight at a glance: the overall line; one row per check (check, invariant, status, value
    against bound); each check's one-line reason; the checks that did not pass in full."""
    checks = report.get("checks", [])
    verdict = "passed" if report.get("passed") else "FAILED"
    lines = [
        f"# Pre-flight {verdict}",
        "",
        f"**{preflight_overall(checks)}**",
        "",
        "| " + " | ".join(PREFLIGHT_COLUMNS) + " |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        "| "
        + " | ".join(
            [
                short(check.get("name", ""), CELL),
                short(check.get("invariant", ""), 12),
                check.get("status", ""),
                short(value_vs_bound(check), VALUE_CELL),
            ]
        )
        + " |"
        for check in checks
    ]
    lines += ["", "## Why", ""]
    for check in checks:
        head = f"- **{check.get('name', '')}** ({check.get('status', '')}): "
        lines.append(head + cut(_reason(check), REASON_LINE - len(head)))
    trouble = [c for c in checks if c.get("status") != "pass"]
    if trouble:
        lines += ["", "## Not passed", ""]
        lines += [
            f"- **{c['name']}** ({c['status']}, {c.get('invariant', '')}): {c.get('detail', '')}"
            + (f". Try: {c['hint']}" if c.get("hint") else "")
            for c in trouble
        ]
    lines += ["", details]
    return "\n".join(lines) + "\n"


def sections(markdown: str) -> dict[str, str]:
    """``{heading: text}`` of a report's ``## `` sections (heading lowercased, the ``## `` line included)."""
    out, current = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            current = line[3:].strip().lower()
            out[current] = line
        elif current is not None:
            out[current] += "\n" + line
    return {heading: text.strip() for heading, text in out.items()}


def eval_markdown(report: str, details: str) -> str:
    """The evaluation's ``## verdict`` and ``## by kind of item`` as written, then the headline table; a
    report without a verdict is published whole."""
    found = sections(report)
    lead = [found[heading] for heading in ("verdict", "by kind of item") if heading in found]
    if not lead:
        return report
    headline = [text for heading, text in found.items() if heading.startswith("headline")]
    return "\n\n".join(["# Evaluation", *lead, *headline, details]) + "\n"
