"""Publish what a stage wrote as Prefect artifacts: reports as markdown, metrics and curves as tables,
figures as images embedded in markdown (``data:`` URIs: the UI shows them with no file server and offline).

Artifacts only show files the CLI already wrote; nothing here computes a result. A missing file is
logged and skipped, so a stage that failed before writing its report still fails with its own reason.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from grpo.config import Config, load_config

MAX_MARKDOWN_CHARS = 50_000
MAX_TABLE_ROWS = 500
MAX_TABLE_LINE = 90
"""A markdown table with a longer row is published as a list: the Prefect UI does not wrap table
cells, so at 1,400 px a wide table's last column (the validation report's ``detail``) is cut off."""


def project_config(project_dir: str | Path) -> Config:
    """The project's params.yaml, read with the one typed loader (paths of the files to publish)."""
    return load_config(Path(project_dir) / "params.yaml")


def _read(path: Path) -> str | None:
    if not path.is_file():
        get_run_logger().warning("%s does not exist: no artifact published for it", path)
        return None
    return path.read_text(encoding="utf-8")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists of scalars are kept as one value."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    """One table row: nested values become compact JSON, so every row has the same columns."""
    return {key: json.dumps(v, default=str) if isinstance(v, dict | list) else v for key, v in row.items()}


def _split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def readable_tables(markdown: str, max_line: int = MAX_TABLE_LINE) -> str:
    """Markdown whose wide tables (a row longer than ``max_line``) become lists that wrap.

    ``| rule | column | result | detail |`` rows become ``- **rule** · column: ... · result: ... · detail: ...``;
    narrow tables and everything else are kept as they are.
    """
    lines, out, i = markdown.splitlines(), [], 0
    while i < len(lines):
        end = i
        while end < len(lines) and lines[end].lstrip().startswith("|"):
            end += 1
        table = lines[i:end]
        if len(table) >= 2 and max(map(len, table)) > max_line:
            header = _split_row(table[0])
            for row in map(_split_row, table[2:]):
                rest = " · ".join(f"{name}: {cell}" for name, cell in zip(header[1:], row[1:], strict=False))
                out.append(f"- **{row[0]}** · {rest}")
        else:
            out += table or [lines[i]]
        i = max(end, i + 1)
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def publish_markdown(path: Path, key: str, description: str) -> None:
    """A markdown file as a markdown artifact (wide tables as lists, so nothing is cut off in the UI)."""
    text = _read(path)
    if text is not None:
        create_markdown_artifact(
            markdown=readable_tables(text)[:MAX_MARKDOWN_CHARS], key=key, description=description
        )


def publish_metrics(path: Path, key: str, description: str) -> None:
    """A metrics JSON file as a two-column table (nested keys dotted)."""
    text = _read(path)
    if text is not None:
        rows = [{"metric": name, "value": value} for name, value in flatten(json.loads(text)).items()]
        create_table_artifact(table=rows, key=key, description=description)


def publish_rows(path: Path, field: str | None, key: str, description: str) -> None:
    """A JSON list of records (or the list under ``field``) as a table."""
    text = _read(path)
    if text is None:
        return
    data = json.loads(text)
    rows = data.get(field, []) if field and isinstance(data, dict) else data
    rows = [_cells(row) if isinstance(row, dict) else {"value": row} for row in rows][:MAX_TABLE_ROWS]
    create_table_artifact(table=rows, key=key, description=description)


def publish_figures(figures: dict[str, Path], key: str, description: str) -> None:
    """PNG files as one markdown artifact, each image embedded under its title (absent files are skipped)."""
    parts = []
    for title, path in figures.items():
        if not path.is_file():
            get_run_logger().warning("%s does not exist: figure %r not published", path, title)
            continue
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts += [f"### {title}", "", f"`{path.name}`", "", f"![{title}](data:image/png;base64,{data})", ""]
    if parts:
        create_markdown_artifact(markdown="\n".join(parts), key=key, description=description)
