"""The dataframe validation runs on: the raw fields of every row plus derived check columns.

A derived column holds what Python computes for one row (e.g. ``fair_ambig_label_unknown``: the
label of an ambiguous item is its unknown option). Rows a check does not apply to hold ``None``,
which Great Expectations' column-map expectations skip, so a rule counts only the rows it is about.
The verdict itself always comes from a GX expectation in ``grpo/data/suite.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from grpo.data.jsonl import RawRow
from grpo.data.loaders import IN_CONTEXT_DISTRACTOR_SOURCES
from grpo.data.schema import ABSTENTION, SPLITS, TASKS, Record, biased_option, content_id
from grpo.data.text import contains, is_unknown_phrase, normalize_answer, text_key

FIELDS = tuple(Record.model_fields)
TEXT_FIELDS = (
    "id",
    "task",
    "source",
    "split",
    "context",
    "question",
    "answer",
    "category",
    "template_id",
    "context_condition",
    "question_polarity",
    "distractor",
    "sft_answer",
)
INT_FIELDS = ("label", "unknown_idx", "target_idx", "sft_label")
LIST_FIELDS = ("choices", "aliases")
SCANNED_TEXT = ("context", "question", "answer", "distractor", "sft_answer", "category", "template_id")
ALWAYS = (
    "split_matches_file",
    "schema_unknown_fields",
    "schema_types",
    "all_text",
    "choice_len_max",
    "utf8_ok",
    "id_matches_content",
    "text_hash",
    "is_train",
    "is_eval",
)
FAIRNESS_REQUIRED = (
    "choices",
    "label",
    "context_condition",
    "question_polarity",
    "unknown_idx",
    "target_idx",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _index_ok(value: Any) -> bool:
    return _is_int(value) and 0 <= value < 3


def _type_problems(data: dict[str, Any]) -> str:
    problems = [
        f"{key} is {type(data[key]).__name__}"
        for key in TEXT_FIELDS
        if data.get(key) is not None and not isinstance(data[key], str)
    ]
    problems += [
        f"{key} is {type(data[key]).__name__}"
        for key in INT_FIELDS
        if data.get(key) is not None and not _is_int(data[key])
    ]
    problems += [
        f"{key} is not a list of strings"
        for key in LIST_FIELDS
        if key in data and not (isinstance(data[key], list) and all(isinstance(v, str) for v in data[key]))
    ]
    if data.get("answerable") is not None and not isinstance(data["answerable"], bool):
        problems.append(f"answerable is {type(data['answerable']).__name__}")
    return ", ".join(problems)


def _strings(data: dict[str, Any], key: str) -> list[str]:
    value = data.get(key)
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _all_text(data: dict[str, Any]) -> str:
    """Every text value of a row as ``field: value`` lines (what the control-character and slot scans read)."""
    lines = [f"{key}: {data[key]}" for key in SCANNED_TEXT if isinstance(data.get(key), str)]
    lines += [f"{key}: {value}" for key in LIST_FIELDS for value in _strings(data, key)]
    return "\n".join(lines)


def _utf8_ok(data: dict[str, Any]) -> bool:
    texts = [data[key] for key in TEXT_FIELDS if isinstance(data.get(key), str)]
    texts += _strings(data, "choices") + _strings(data, "aliases")
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _id_matches(data: dict[str, Any]) -> bool:
    try:
        return data["id"] == content_id(
            data["task"], data["context"], data["question"], data.get("choices", []), data["answer"]
        )
    except (KeyError, TypeError):
        return False


def _fairness(d: dict[str, Any]) -> dict[str, Any]:
    choices = d.get("choices") if isinstance(d.get("choices"), list) else []
    label, unknown, target = d.get("label"), d.get("unknown_idx"), d.get("target_idx")
    ok = len(choices) == 3 and all(_index_ok(v) for v in (label, unknown, target))
    names = [normalize_answer(c) if isinstance(c, str) else "" for c in choices]
    condition = d.get("context_condition")
    return {
        "fair_missing": ", ".join(key for key in FAIRNESS_REQUIRED if d.get(key) is None),
        "fair_n_choices": len(choices),
        "fair_choices_distinct": all(names) and len(set(names)) == len(names),
        "fair_label_in_range": _index_ok(label),
        "fair_unknown_idx_in_range": _index_ok(unknown),
        "fair_target_idx_in_range": _index_ok(target) and target != unknown,
        "fair_unknown_options": sum(isinstance(c, str) and is_unknown_phrase(c) for c in choices),
        "fair_unknown_idx_matches": ok and is_unknown_phrase(str(choices[unknown])),
        "fair_ambig_label_unknown": (ok and label == unknown) if condition == "ambig" else None,
        "fair_disambig_label_known": (ok and label != unknown) if condition == "disambig" else None,
        "fair_answer_is_choice": ok and d.get("answer") == choices[label],
    }


def _hallucination(d: dict[str, Any]) -> dict[str, Any]:
    context, answer, answerable = str(d.get("context") or ""), d.get("answer"), d.get("answerable")
    distractor = d.get("distractor")
    missing = [] if isinstance(answerable, bool) else ["answerable"]
    if answerable is False and not distractor:
        missing.append("distractor")
    gold = {normalize_answer(a) for a in [answer, *_strings(d, "aliases")] if isinstance(a, str)}
    in_context_ok = d.get("source") in IN_CONTEXT_DISTRACTOR_SOURCES
    return {
        "hall_missing": ", ".join(missing),
        "hall_no_choices": not d.get("choices") and all(d.get(k) is None for k in INT_FIELDS[:3]),
        "hall_answer_in_context": (
            isinstance(answer, str) and answer != ABSTENTION and contains(context, answer)
        )
        if answerable is True
        else None,
        "hall_abstains": answer == ABSTENTION if answerable is False else None,
        "hall_distractor_not_in_context": not contains(context, str(distractor))
        if answerable is False and distractor and not in_context_ok
        else None,
        "hall_distractor_not_gold": (
            normalize_answer(str(distractor)) not in gold and distractor != ABSTENTION
        )
        if distractor
        else None,
    }


def _noisy_label(d: dict[str, Any]) -> int | None:
    """The biased option an ambiguous item's SFT noise may teach (None when it has none)."""
    unknown, target = d.get("unknown_idx"), d.get("target_idx")
    if (
        d.get("context_condition") != "ambig"
        or not (_index_ok(unknown) and _index_ok(target))
        or unknown == target
    ):
        return None
    return biased_option(d.get("question_polarity"), unknown, target)


def _sft(d: dict[str, Any]) -> dict[str, Any]:
    split, task = d.get("split"), d.get("task")
    key = "sft_label" if task == "fairness" else "sft_answer"
    if split == "eval":
        extra = [k for k in ("sft_label", "sft_answer") if d.get(k) is not None]
        return {"sft_fields": ", ".join(f"{k} on an eval record" for k in extra)}
    if split != "train" or task not in TASKS:
        return {}
    if d.get(key) is None:
        return {"sft_fields": f"missing {key}"}
    if task == "fairness":
        noised = d["sft_label"] != d.get("label")
        return {
            "sft_fields": "",
            "sft_consistent": not noised or d["sft_label"] == _noisy_label(d),
            "sft_noised_fair": float(noised) if d.get("context_condition") == "ambig" else None,
        }
    noised = d["sft_answer"] != d.get("answer")
    eligible = d.get("answerable") is False and bool(d.get("distractor"))
    return {
        "sft_fields": "",
        "sft_consistent": not noised or (eligible and d["sft_answer"] == d["distractor"]),
        "sft_noised_hall": float(noised) if eligible else None,
    }


def _balance(d: dict[str, Any]) -> dict[str, Any]:
    split, task = d.get("split"), d.get("task")
    if split not in SPLITS or task not in TASKS:
        return {}
    out: dict[str, Any] = {f"is_fairness_{split}": float(task == "fairness")}
    if task == "fairness":
        if d.get("context_condition") in ("ambig", "disambig"):
            out[f"ambig_{split}"] = float(d["context_condition"] == "ambig")
        if d.get("question_polarity") in ("neg", "nonneg"):
            out[f"neg_{split}"] = float(d["question_polarity"] == "neg")
        if _index_ok(d.get("label")):
            out.update({f"label{k}_{split}": float(d["label"] == k) for k in range(3)})
    elif isinstance(d.get("answerable"), bool):
        out[f"answerable_{split}"] = float(d["answerable"])
    return out


def _printable(value: Any) -> Any:
    """Lone surrogates escaped (pandas' string arrays refuse them); ``text.utf8`` still flags the row."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_printable(item) for item in value]
    return value


def _row(raw: RawRow, file_split: str) -> dict[str, Any]:
    d = raw.data
    row: dict[str, Any] = {"_file": raw.file, "_line": raw.line}
    row["split_matches_file"] = d.get("split") == file_split
    # Wrongly typed values are reported by schema.types and kept out of the text checks.
    for key in FIELDS:
        value = d.get(key)
        wrong_text = key in TEXT_FIELDS and value is not None and not isinstance(value, str)
        row[key] = None if wrong_text else _printable(value)
    row["schema_unknown_fields"] = ", ".join(sorted(set(d) - set(FIELDS)))
    row["schema_types"] = _type_problems(d)
    row["all_text"] = _printable(_all_text(d))
    row["choice_len_max"] = max((len(c) for c in _strings(d, "choices")), default=None)
    row["utf8_ok"] = _utf8_ok(d)
    row["id_matches_content"] = _id_matches(d) if isinstance(d.get("id"), str) else None
    row["text_hash"] = (
        text_key(d["context"], d["question"])
        if all(isinstance(d.get(k), str) for k in ("context", "question"))
        else None
    )
    row.update(_fairness(d) if d.get("task") == "fairness" else {})
    row.update(_hallucination(d) if d.get("task") == "hallucination" else {})
    row.update(_sft(d))
    row.update(_balance(d))
    for split in SPLITS:
        row[f"is_{split}"] = float(d.get("split") == split)
    return row


def _leaks(frame: pd.DataFrame, column: str) -> list[bool | None]:
    """Per row: whether its value also occurs in the other split (None where the value is missing)."""
    present = [isinstance(value, str) for value in frame[column]]
    splits_of: dict[str, set[str]] = defaultdict(set)
    for value, split, ok in zip(frame[column], frame["split"], present, strict=True):
        if ok and split in SPLITS:
            splits_of[value].add(split)
    return [
        len(splits_of[value]) > 1 if ok else None for value, ok in zip(frame[column], present, strict=True)
    ]


def build_frame(rows_by_split: Mapping[str, Sequence[RawRow]]) -> pd.DataFrame:
    """One row per parsed record of each split's file: raw fields and every derived check column."""
    records = [_row(raw, split) for split, rows in rows_by_split.items() for raw in rows]
    frame = (
        pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=["_file", "_line", *FIELDS])
    )
    # Columns the fixed rules read exist even when no row has them (e.g. both files missing).
    for column in ALWAYS:
        if column not in frame:
            frame[column] = None
    frame["id_leak"] = _leaks(frame, "id")
    frame["text_leak"] = _leaks(frame, "text_hash")
    return frame
