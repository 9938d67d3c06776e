"""The kinds of item of each task, the unit an outcome is judged by.

Each task has an item kind whose context cannot tell (ambiguous, unanswerable: the right reply is
"unknown" / an abstention) and one whose context answers (disambiguated, answerable). A policy can
raise its mean reward by saying "unknown" everywhere, gaining on the first kind and losing on the
second: judged kind by kind, that is a trade, not progress. Training (per-kind reward and abstention
each step, ``grpo/health/kinds.py``), selection (``grpo/train/selection.py``) and evaluation
(``grpo/eval/verdict.py``) all read the kinds from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KINDS: dict[str, tuple[str, str]] = {
    "fairness": ("ambiguous", "disambiguated"),
    "hallucination": ("answerable", "unanswerable"),
}
"""The kinds of item of each task."""

ANSWERED_KINDS = ("disambiguated", "answerable")
"""The kinds whose context gives the answer: an "unknown" or an abstention there is a loss."""

ALL_KINDS = tuple(kind for kinds in KINDS.values() for kind in kinds)
"""Every kind, task by task."""


def record_kind(record: Mapping[str, Any]) -> str:
    """The kind of item (``KINDS``) of a record of either task (as read from the processed JSONL)."""
    if record["task"] == "fairness":
        return "ambiguous" if record["context_condition"] == "ambig" else "disambiguated"
    return "answerable" if record["answerable"] else "unanswerable"
