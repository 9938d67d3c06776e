"""Validation results as named rules with example rows: ``validation.json``, ``validation.md``, the error."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import pandas as pd

from grpo.data.jsonl import ReadProblem


class RuleResult(NamedTuple):
    """The verdict of one expectation (or one read-time rule)."""

    rule: str
    """Rule name, e.g. ``fairness.ambig_label_unknown`` or ``read.json``."""
    column: str | None
    """Column the expectation ran on (a derived column for computed checks)."""
    expectation: str
    """GX expectation type, or ``read`` for problems found while reading the files."""
    success: bool
    """Whether the rule held."""
    element_count: int | None
    """Rows the rule looked at."""
    unexpected_count: int | None
    """Rows that broke it."""
    observed: Any
    """Observed value of an aggregate rule (a share, a count), else None."""
    examples: list[dict[str, Any]]
    """A few offending rows: file, line, id and the offending value."""
    error: str | None
    """GX's exception message when the expectation could not run (counted as a failure)."""


class ValidationReport(NamedTuple):
    """Everything ``grpo validate`` decided."""

    files: list[str]
    n_rows: int
    rules: list[RuleResult]

    @property
    def success(self) -> bool:
        return all(rule.success for rule in self.rules)

    @property
    def failures(self) -> list[RuleResult]:
        return [rule for rule in self.rules if not rule.success]


def _plain(value: Any) -> Any:
    """JSON-safe copy of a GX value (numpy scalars, NaN, tuples)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def read_results(problems: Sequence[ReadProblem], max_examples: int) -> list[RuleResult]:
    """One failed rule per kind of read problem, with its first lines as examples."""
    out = []
    for rule in dict.fromkeys(problem.rule for problem in problems):
        hits = [problem for problem in problems if problem.rule == rule]
        examples = [{"file": p.file, "line": p.line, "detail": p.detail} for p in hits[:max_examples]]
        out.append(RuleResult(rule, None, "read", False, None, len(hits), None, examples, None))
    return out


SUMMARY_FIELDS = (
    "task",
    "question",
    "answer",
    "choices",
    "label",
    "unknown_idx",
    "target_idx",
    "context_condition",
    "question_polarity",
    "answerable",
    "distractor",
    "sft_label",
    "sft_answer",
)
"""Fields shown with an offending row, so a derived ``False`` can be read without opening the file."""


def _short(value: Any, limit: int = 120) -> Any:
    value = _plain(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)  # pandas stores an int column with gaps as floats
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


def _examples(result: dict[str, Any], frame: pd.DataFrame, max_examples: int) -> list[dict[str, Any]]:
    values = result.get("partial_unexpected_list") or []
    indices = result.get("partial_unexpected_index_list") or []
    examples = []
    for index, value in list(zip(indices, values, strict=False))[:max_examples]:
        row = frame.loc[index]
        summary = {
            key: _short(row[key]) for key in SUMMARY_FIELDS if key in row and not _is_missing(row[key])
        }
        examples.append(
            {
                "file": row["_file"],
                "line": int(row["_line"]),
                "id": _plain(row.get("id")),
                "value": _short(value, 300),
                "row": summary,
            }
        )
    return examples


def _is_missing(value: Any) -> bool:
    if isinstance(value, list):
        return not value
    return value is None or (isinstance(value, float) and math.isnan(value))


def _raised(info: dict[str, Any] | None) -> str | None:
    """The message of an exception GX caught while running an expectation, or None. GX gives it flat
    (``{"raised_exception": True, "exception_message": ...}``) or, when a metric could not be computed
    (a missing column), one such entry per metric."""
    entries = [info] if info and "raised_exception" in info else list((info or {}).values())
    messages = [str(e.get("exception_message")) for e in entries if isinstance(e, dict) and e.get("raised_exception")]
    return "; ".join(dict.fromkeys(messages)) or None


def gx_results(results: Sequence[Any], frame: pd.DataFrame, max_examples: int) -> list[RuleResult]:
    """GX ``ExpectationValidationResult``s -> rule results, in suite order."""
    out = []
    for item in results:
        config, result = item.expectation_config, item.result or {}
        kwargs = config.kwargs
        error = _raised(item.exception_info)
        column = kwargs.get("column") or ",".join(kwargs.get("column_list", []))
        observed = result.get("observed_value")
        if observed is not None:
            observed = {
                "value": _plain(observed),
                "min": kwargs.get("min_value"),
                "max": kwargs.get("max_value"),
            }
        out.append(
            RuleResult(
                rule=config.meta["rule"],
                column=column,
                expectation=config.type,
                success=bool(item.success),
                element_count=_plain(result.get("element_count")),
                unexpected_count=_plain(result.get("unexpected_count")),
                observed=observed,
                examples=_examples(result, frame, max_examples),
                error=error,
            )
        )
    return out


def to_json(report: ValidationReport) -> str:
    payload = {
        "success": report.success,
        "files": report.files,
        "n_rows": report.n_rows,
        "n_rules": len(report.rules),
        "n_failed": len(report.failures),
        "failed_rules": sorted({rule.rule for rule in report.failures}),
        "rules": [_plain(rule._asdict()) for rule in report.rules],
    }
    return json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n"


def _describe(rule: RuleResult) -> str:
    if rule.error:
        return f"could not run: {rule.error}"
    if rule.observed is not None:
        o = rule.observed
        return f"observed {o['value']!r}, expected between {o['min']} and {o['max']}"
    return f"{rule.unexpected_count} of {rule.element_count if rule.element_count is not None else '?'} rows"


def _example_text(example: dict[str, Any]) -> str:
    where = f"{example['file']}:{example['line']}"
    if "detail" in example:
        return f"{where}: {example['detail']}"
    value = json.dumps(example.get("value"), ensure_ascii=True, default=str)
    row = json.dumps(example.get("row", {}), ensure_ascii=True, default=str)
    return f"{where} (id {example.get('id')}): value {value} in {row}"


def sources_markdown(sources: dict[str, Any]) -> list[str]:
    """The ``## Raw sources`` section: each task's source, path and skipped raw items by file, category, reason."""
    lines = [
        "## Raw sources",
        "",
        "| task | source | path | skipped raw items |",
        "| --- | --- | --- | --- |",
    ]
    for task, entry in sorted(sources.items()):
        total = sum(row["count"] for row in entry["skipped"])
        lines.append(f"| {task} | {entry['source']} | {entry['path'] or ''} | {total} |")
    rows = [(task, row) for task, entry in sorted(sources.items()) for row in entry["skipped"]]
    if rows:
        lines += ["", "| task | file | category | reason | count |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {task} | {row['file']} | {row['category']} | {row['reason']} | {row['count']} |"
            for task, row in rows
        ]
    return lines + [""]


def to_markdown(report: ValidationReport, sources: dict[str, Any] | None = None) -> str:
    """``validation.md``: verdict, failed rules with rows, every rule, and the raw sources' skip summary."""
    verdict = "PASSED" if report.success else f"FAILED ({len(report.failures)} of {len(report.rules)} rules)"
    lines = [
        f"# Data validation: {verdict}",
        "",
        f"Files: {', '.join(report.files)}; {report.n_rows} records.",
        "",
    ]
    if report.failures:
        lines += ["## Failed rules", ""]
        for rule in report.failures:
            lines.append(f"- **{rule.rule}** (`{rule.column or rule.expectation}`): {_describe(rule)}")
            lines += [f"  - {_example_text(example)}" for example in rule.examples]
        lines.append("")
    if sources:
        lines += sources_markdown(sources)
    lines += ["## All rules", "", "| rule | column | result | detail |", "| --- | --- | --- | --- |"]
    for rule in report.rules:
        lines.append(
            f"| {rule.rule} | {rule.column or ''} | {'pass' if rule.success else 'FAIL'} | {_describe(rule)} |"
        )
    return "\n".join(lines) + "\n"


def failure_message(report: ValidationReport, details: str) -> str:
    """The error text: the broken rules named on its first line (the line a failed run leads with), then
    each failed rule, its column, and its first example rows."""
    names = [rule.rule for rule in report.failures]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    parts = [
        f"data validation failed: {len(names)} of {len(report.rules)} rules broken: {shown} "
        f"(every rule and row: {details})"
    ]
    for rule in report.failures:
        examples = "; ".join(_example_text(example) for example in rule.examples[:2])
        parts.append(
            f"- {rule.rule} [{rule.column or rule.expectation}]: {_describe(rule)}"
            + (f", e.g. {examples}" if examples else "")
        )
    parts.append("fix the data source or generator and rerun `grpo prepare`, then `grpo validate`")
    return "\n".join(parts)
