"""Drawing generated items whose (context, question) pair has not been drawn before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo.data.errors import DataSourceError

MAX_ATTEMPTS = 200
"""Draws per item before the generator gives up (its template space is exhausted)."""


def draw_distinct(
    draw: Callable[[], dict[str, Any]], seen: set[tuple[str, str]], what: str, fix: str
) -> dict:
    """Call ``draw`` until its item's (context, question) is new; record it in ``seen``.

    Raises DataSourceError naming ``what`` and the ``fix`` when MAX_ATTEMPTS draws all repeat."""
    for _ in range(MAX_ATTEMPTS):
        item = draw()
        key = (item["context"], item["question"])
        if key not in seen:
            seen.add(key)
            return item
    raise DataSourceError(f"{what}: could not draw a new distinct item after {MAX_ATTEMPTS} tries; {fix}")
