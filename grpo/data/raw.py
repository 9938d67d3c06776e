"""Reading published raw files: clear ``file:line`` errors for bad bytes or JSON, and leak-free group splits."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from grpo.data.errors import DataSourceError
from grpo.data.jsonl import ReadProblem, parse_line
from grpo.data.splits import assign_groups

Pools = dict[str, list[dict[str, Any]]]

"""``(file, category, reason)``: one kind of skipped raw item."""


class Loaded(NamedTuple):
    """What a loader returns: content fields per split, and how many raw items it skipped and why."""

    pools: Pools
    skipped: Counter
    """``(file, category, reason)`` -> number of raw items skipped for that reason."""


def skip_lines(skipped: Counter, limit: int = 12) -> list[str]:
    """``"N x file [category]: reason"`` lines, largest first (for the errors and the validation report)."""
    ordered = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))
    lines = [
        f"{n} x {Path(file).name} [{category}]: {reason}" for (file, category, reason), n in ordered[:limit]
    ]
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more kinds (see reports/validation.md)")
    return lines


def _raise_read_problem(problem: ReadProblem) -> None:
    fix = "re-save the file as UTF-8" if problem.rule == "read.utf8" else "fix or remove the line"
    raise DataSourceError(f"{problem.file}:{problem.line}: {problem.detail}; {fix}")


def json_lines(path: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """``(file, line number, object)`` for every non-empty line; a bad byte or line is named and raised."""
    rows = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        parsed = parse_line(raw.rstrip(b"\r"), str(path), number)
        if isinstance(parsed, ReadProblem):
            _raise_read_problem(parsed)
        elif parsed is not None:
            rows.append((parsed.file, parsed.line, parsed.data))
    return rows


def json_file(path: Path) -> Any:
    """A whole JSON document; bad bytes are named by line and byte offset."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        bad = data[exc.start : exc.end]
        raise DataSourceError(
            f"{path}:{line}: bytes {bad!r} at byte {exc.start} are not UTF-8; re-save the file as UTF-8"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataSourceError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None


def files(path: Path, pattern: str) -> list[Path]:
    """The dataset files: ``path`` itself, or the ``pattern`` files of a folder."""
    if path.is_dir():
        found = sorted(path.glob(pattern))
        if not found:
            raise DataSourceError(
                f"{path}: no {pattern} files in this folder; point the path at the dataset files"
            )
        return found
    if not path.is_file():
        raise DataSourceError(f"{path}: no such file or folder; download the dataset and give its local path")
    return [path]


def split_groups(
    groups: dict[str, list[dict[str, Any]]], eval_share: float, seed: int, path: Path, kind: str
) -> Pools:
    """Whole groups (``kind``: templates, articles, questions) to train or eval; fewer than 2 cannot split."""
    if len(groups) < 2:
        raise DataSourceError(
            f"{path}: {len(groups)} {kind} with usable items; needs >= 2 {kind} to split train/eval "
            f"without leakage (no {kind[:-1]} may cross the splits): give a file with more {kind}"
        )
    assignment = assign_groups(groups, eval_share, seed)
    pools: Pools = {"train": [], "eval": []}
    for key in sorted(groups):
        pools[assignment[key]].extend(groups[key])
    return pools
