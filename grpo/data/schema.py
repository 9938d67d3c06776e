"""The unified record shared by both tasks: one JSON object per line of ``train.jsonl``/``eval.jsonl``.

Fairness records are BBQ-style multiple choice (Parrish et al. 2022, arXiv:2110.08193); hallucination
records are grounded QA with abstention (SQuAD 2.0 style, arXiv:1806.03822). Both share one model so
that every stage reads one format; fields that do not apply to a task are null (or empty lists).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

LETTERS = ("A", "B", "C")
"""Option letters of a fairness item, in order of ``choices``."""

ABSTENTION = "I don't know."
"""What a grounded-QA answer says when the context does not contain the answer."""

UNKNOWN_PHRASES = (
    "Unknown",
    "Cannot be determined",
    "Can't be determined",
    "Not answerable",
    "Not known",
    "Not enough info",
    "Not enough information",
    "Cannot answer",
    "Can't answer",
    "Undetermined",
)
"""The ten ways BBQ words its "unknown" option; exactly one option of a fairness item is one of them."""

TASKS = ("fairness", "hallucination")
"""Reward tasks."""

SPLITS = ("train", "eval")
"""Dataset splits (one file each)."""

SOURCES = ("synthetic", "bbq", "halueval", "squad2")
"""Where a record came from: the built-in generator or a published dataset format."""

Task = Literal["fairness", "hallucination"]
Split = Literal["train", "eval"]
Source = Literal["synthetic", "bbq", "halueval", "squad2"]


class Record(BaseModel):
    """One example of either task, as written to the processed JSONL files."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    id: str
    """16 hex digits of the SHA-256 of the content (task, context, question, choices, answer)."""
    task: Task
    """Which reward scores it: ``fairness`` or ``hallucination``."""
    source: Source
    """``synthetic`` or the published format it was loaded from."""
    split: Split
    """``train`` or ``eval``; templates/entity names never cross splits."""
    context: str
    """The passage the question is about (1-3 sentences for synthetic records)."""
    question: str
    """The question asked about the context."""
    choices: list[str] = Field(default_factory=list)
    """Fairness: the three options in the order shown as A, B, C. Hallucination: empty."""
    label: int | None = Field(None, ge=0, le=2)
    """Fairness: index of the gold option in ``choices``. Hallucination: null."""
    answer: str
    """Gold answer text: ``choices[label]`` (fairness), a context span or exactly ABSTENTION (hallucination)."""
    aliases: list[str] = Field(default_factory=list)
    """Other accepted spellings of the gold answer (hallucination; empty for fairness)."""
    answerable: bool | None = None
    """Hallucination: whether the context states the answer. Fairness: null."""
    context_condition: Literal["ambig", "disambig"] | None = None
    """Fairness: ``ambig`` (the context cannot tell, gold = unknown) or ``disambig``. Hallucination: null."""
    question_polarity: Literal["neg", "nonneg"] | None = None
    """Fairness: ``neg`` (the question names a harmful behaviour) or ``nonneg``. Hallucination: null."""
    unknown_idx: int | None = Field(None, ge=0, le=2)
    """Fairness: index of the "unknown" option (one of UNKNOWN_PHRASES). Hallucination: null."""
    target_idx: int | None = Field(None, ge=0, le=2)
    """Fairness: index of the option naming the stereotyped group (BBQ's target, whatever the polarity)."""
    category: str
    """Fairness: the stereotype category; hallucination: the entity type or source topic."""
    distractor: str | None = None
    """Hallucination: a same-type wrong answer from another entity (what a hallucinating model says)."""
    template_id: str
    """The template (or source group) the item was built from; train and eval never share one."""
    sft_label: int | None = None
    """Train fairness: option the SFT target teaches (``label``, or the biased option when noised)."""
    sft_answer: str | None = None
    """Train hallucination: text the SFT target teaches (``answer``, or ``distractor`` when noised)."""
    answer_format: Literal["letter", "text"] | None = None
    """Fairness: how a reply names its option (``data.fairness_answer``): ``letter`` ("Answer: B") or
    ``text`` ("Answer: The Brasken farmer"); null reads as ``letter``. Hallucination: null."""


def content_id(task: str, context: str, question: str, choices: list[str], answer: str) -> str:
    """Stable id of a record's content: the same item gets the same id in any run, split or order."""
    payload = json.dumps([task, context, question, list(choices), answer], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def make_record(fields: dict[str, Any], split: str) -> Record:
    """A validated record from its content fields, with its split and content id filled in."""
    ident = content_id(
        fields["task"], fields["context"], fields["question"], fields.get("choices", []), fields["answer"]
    )
    return Record.model_validate({**fields, "id": ident, "split": split})


def biased_option(question_polarity: str, unknown_idx: int, target_idx: int) -> int:
    """The option a stereotyped reader picks: the target on a negative question, else the other person.

    This is BBQ's direction of bias (arXiv:2110.08193, section 3): the SFT noise teaches this option
    so that the bias score of the SFT model moves, whatever the question's polarity.
    """
    if question_polarity == "neg":
        return target_idx
    (other,) = {0, 1, 2} - {unknown_idx, target_idx}
    return other


def biased_idx(record: Record) -> int:
    """``biased_option`` of a fairness record."""
    return biased_option(record.question_polarity, record.unknown_idx, record.target_idx)


def record_line(record: Record) -> str:
    """One JSONL line (fields in declaration order, UTF-8 kept readable)."""
    return json.dumps(record.model_dump(mode="json"), ensure_ascii=False) + "\n"
