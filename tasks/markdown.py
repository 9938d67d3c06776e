"""Markdown that the Prefect UI shows without horizontal scrolling at 1,280 px, and the check of it.

The UI wraps paragraphs but neither table cells nor code blocks: a wide table or a long code line
scrolls sideways in its box, and whatever is to the right is out of sight. At 1,280 px the artifact
page leaves the markdown a box of about 700 px between its menu and its details panel, which holds
about 85 characters of a table row (cells do not wrap) or of a code line (docs/experiments/prefect-ui.md).
So every artifact keeps to bounds that can be checked on its text, with no browser:

- a line outside tables and code blocks: at most ``LINE`` characters (images are exempt: the UI
  scales them to the box). The UI wraps a long line itself, but it also breaks the line at every
  newline of the source: a line short enough to fit the box keeps those breaks where the text would
  wrap anyway, so a wrapped paragraph does not come out ragged;
- a table row: at most ``ROW`` characters, and each cell at most ``CELL``;
- a line inside a fenced code block: at most ``CODE`` characters.

``width_problems`` is the check (tests run it on every artifact a real flow run publishes);
``fit`` rewrites any markdown to pass it: a table with a wide row or cell becomes a list, a long line
is wrapped (list items keep their indent), a long code line is broken in two with an indent.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator

LINE = 90
ROW = 80
CELL = 40
CODE = 80
FENCE = re.compile(r"^\s*(```|~~~)")
IMAGE = re.compile(r"^\s*!\[[^\]]*\]\([^)]*\)\s*$")
LIST_ITEM = re.compile(r"^(\s*(?:[-*+]|\d+[.)])\s+|\s*>\s*)")


def _blocks(markdown: str) -> Iterator[tuple[str, list[str]]]:
    """``(kind, lines)`` in order; kind is ``table``, ``code`` (fences included) or ``text``."""
    lines, i = markdown.splitlines(), 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            end = i + 1
            while end < len(lines) and not FENCE.match(lines[end]):
                end += 1
            yield "code", lines[i : end + 1]
            i = end + 1
        elif lines[i].lstrip().startswith("|"):
            end = i
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            yield "table", lines[i:end]
            i = end
        else:
            yield "text", [lines[i]]
            i += 1


def cells(row: str) -> list[str]:
    """The cells of one table row (``| a | b \\| c |`` -> ``["a", "b \\| c"]``: an escaped pipe stays)."""
    inner = re.sub(r"^\s*\|", "", re.sub(r"(?<!\\)\|\s*$", "", row))
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", inner)]


def table_cell(text: str) -> str:
    """``text`` made safe inside a table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table_fits(rows: list[str]) -> bool:
    return all(len(row) <= ROW and all(len(cell) <= CELL for cell in cells(row)) for row in rows)


def width_problems(markdown: str) -> list[str]:
    """Every line that would make the artifact scroll sideways at 1,280 px (empty: it fits)."""
    problems = []
    for kind, lines in _blocks(markdown):
        for line in lines:
            if kind == "table" and (len(line) > ROW or max(map(len, cells(line))) > CELL):
                problems.append(
                    f"table row of {len(line)} chars (cells <= {CELL}, row <= {ROW}): {line[:80]}"
                )
            elif kind == "code" and len(line) > CODE:
                problems.append(f"code line of {len(line)} chars (> {CODE}): {line[:80]}")
            elif kind == "text" and len(line) > LINE and not IMAGE.match(line):
                problems.append(f"line of {len(line)} chars (> {LINE}): {line[:80]}")
    return problems


def _wrap(line: str) -> list[str]:
    """A long line as several of at most ``LINE`` characters; a list item's continuation is indented."""
    if len(line) <= LINE or IMAGE.match(line):
        return [line]
    if line.lstrip().startswith("#"):  # a heading cannot continue on the next line: cut it
        return [line[: LINE - 1] + "…"]
    marker = LIST_ITEM.match(line)
    indent = " " * len(marker.group(1)) if marker else ""
    if marker and marker.group(1).strip() == ">":
        indent = marker.group(1)
    return textwrap.wrap(line, LINE, subsequent_indent=indent, break_on_hyphens=False) or [line]


def _as_list(rows: list[str]) -> list[str]:
    """A table as one list item per row: ``- **first cell** · header: cell · ...``."""
    header = cells(rows[0])
    out = []
    for row in map(cells, rows[2:]):
        rest = " · ".join(f"{name}: {cell}" for name, cell in zip(header[1:], row[1:], strict=False))
        out.append(f"- **{row[0]}** · {rest}" if rest else f"- **{row[0]}**")
    return out


def _code_line(line: str) -> list[str]:
    """A long code line broken at spaces where it can, the continuation indented."""
    if len(line) <= CODE:
        return [line]
    return textwrap.wrap(line, CODE, subsequent_indent="    ", break_on_hyphens=False) or [line]


def fit(markdown: str) -> str:
    """``markdown`` rewritten so that ``width_problems`` finds nothing (narrow content is unchanged)."""
    out: list[str] = []
    for kind, lines in _blocks(markdown):
        if kind == "table":
            fits = len(lines) < 2 or _table_fits(lines)
            out += lines if fits else [wrapped for item in _as_list(lines) for wrapped in _wrap(item)]
        elif kind == "code":
            out += [part for line in lines for part in _code_line(line)]
        else:
            out += _wrap(lines[0])
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def wrap_code(text: str) -> str:
    """``text`` as a fenced code block whose lines are at most ``CODE`` characters."""
    lines = [part for line in text.splitlines() for part in _code_line(line)]
    return "\n".join(["```", *lines, "```"])
