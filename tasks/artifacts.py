"""Publish what a stage wrote as Prefect artifacts: reports as markdown, metrics and curves as tables,
figures as images embedded in markdown (``data:`` URIs: the UI shows them with no file server and offline).

Artifacts only show files the CLI already wrote; nothing here computes a result. A missing file is
logged and skipped, so a stage that failed before writing its report still fails with its own reason.
Every artifact fits the UI at 1,280 px (tasks/markdown.py): markdown is fitted, table cells are short.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from grpo.config import Config, load_config
from tasks.markdown import CELL, fit

MAX_MARKDOWN_CHARS = 50_000
MAX_TABLE_ROWS = 500


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


def cell(value: Any) -> Any:
    """One table cell: a float to 4 significant digits, nested values as compact JSON, nothing wider than
    ``markdown.CELL`` characters (a long hash or list is shortened: the file keeps the whole value)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    text = json.dumps(value, default=str) if isinstance(value, dict | list) else value
    if isinstance(text, str) and len(text) > CELL:
        return text[: CELL - 1] + "…"
    return text


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    return {key: cell(v) for key, v in row.items()}


def publish_text(markdown: str, key: str, description: str) -> None:
    """Markdown as an artifact, fitted to the UI's width (``markdown.fit``: wide tables become lists)."""
    create_markdown_artifact(markdown=fit(markdown)[:MAX_MARKDOWN_CHARS], key=key, description=description)


def publish_markdown(path: Path, key: str, description: str) -> None:
    """A markdown file as a markdown artifact (fitted, so nothing is cut off in the UI)."""
    text = _read(path)
    if text is not None:
        publish_text(text, key, description)


def publish_metrics(path: Path, key: str, description: str) -> None:
    """A metrics JSON file as a two-column table (nested keys dotted, values rounded)."""
    text = _read(path)
    if text is not None:
        rows = [{"metric": name, "value": cell(value)} for name, value in flatten(json.loads(text)).items()]
        create_table_artifact(table=rows, key=key, description=description)


def publish_rows(path: Path, field: str | None, key: str, description: str) -> None:
    """A JSON list of records (or the list under ``field``) as a table."""
    text = _read(path)
    if text is None:
        return
    data = json.loads(text)
    rows = data.get(field, []) if field and isinstance(data, dict) else data
    rows = [_cells(row) if isinstance(row, dict) else {"value": cell(row)} for row in rows][:MAX_TABLE_ROWS]
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
