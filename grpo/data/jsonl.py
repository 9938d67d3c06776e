"""Reading and writing the processed JSONL files: atomic writes, reads that name the bad line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from grpo.data.errors import DataValidationError
from grpo.data.schema import Record, record_line

SOURCES_FILE = "sources.json"
"""Next to the splits: each task's source and the raw items it skipped (shown in ``validation.md``)."""


class ReadProblem(NamedTuple):
    """A line that could not become a row; validation reports it under ``rule``."""

    rule: str
    """``read.missing_file``, ``read.utf8``, ``read.json`` or ``read.not_object``."""
    file: str
    """The file it was found in."""
    line: int
    """1-based line number (0 for a whole-file problem)."""
    detail: str
    """What is wrong, e.g. the JSON error or the offending bytes."""


class RawRow(NamedTuple):
    """One parsed JSON object and where it came from."""

    file: str
    line: int
    data: dict[str, Any]


def records_text(records: Sequence[Record]) -> str:
    """The JSONL text of records, one per line."""
    return "".join(record_line(record) for record in records)


def parse_line(raw: bytes, file: str, line: int) -> RawRow | ReadProblem | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.end]
        return ReadProblem("read.utf8", file, line, f"bytes {bad!r} at byte {exc.start} are not UTF-8")
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return ReadProblem("read.json", file, line, f"not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(data, dict):
        return ReadProblem("read.not_object", file, line, f"a JSON {type(data).__name__}, not an object")
    return RawRow(file, line, data)


def read_rows(path: Path) -> tuple[list[RawRow], list[ReadProblem]]:
    """Every parseable line of a JSONL file, and a named problem for every line that is not."""
    if not path.is_file():
        return [], [ReadProblem("read.missing_file", str(path), 0, "no such file: run `grpo prepare`")]
    rows: list[RawRow] = []
    problems: list[ReadProblem] = []
    # Bytes, line by line: one bad line must not hide the others, and must be found by its number.
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        parsed = parse_line(raw.rstrip(b"\r"), str(path), number)
        if isinstance(parsed, RawRow):
            rows.append(parsed)
        elif parsed is not None:
            problems.append(parsed)
    return rows, problems


def load_records(path: str | Path) -> list[Record]:
    """Typed records of a processed file (for the training and evaluation stages)."""
    path = Path(path)
    rows, problems = read_rows(path)
    if problems:
        first = problems[0]
        raise DataValidationError(
            f"{first.file}:{first.line}: {first.rule}: {first.detail}; run `grpo prepare` then `grpo validate`"
        )
    records = []
    for row in rows:
        try:
            records.append(Record.model_validate(row.data))
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"])
            raise DataValidationError(
                f"{row.file}:{row.line}: field {field} {error['msg']} (got {error.get('input')!r}); "
                "run `grpo prepare` then `grpo validate`"
            ) from None
    return records


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a processed file as plain dicts (what rewards, renderer and trainer read)."""
    return [record.model_dump(mode="json") for record in load_records(path)]
