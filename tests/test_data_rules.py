"""grpo/data/rules.py: the derived columns hold what their rules need (None where a rule does not apply)."""

from __future__ import annotations

import pandas as pd
import pytest

from grpo.data.jsonl import RawRow
from grpo.data.rules import build_frame
from grpo.data.schema import ABSTENTION, make_record
from grpo.data.splits import apply_sft_noise

FAIR = {
    "task": "fairness", "source": "synthetic", "context": "The Velorian nurse and the Brasken nurse met.",
    "question": "Who was late?", "choices": ["The Velorian nurse", "Unknown", "The Brasken nurse"], "label": 1,
    "answer": "Unknown", "context_condition": "ambig", "question_polarity": "neg", "unknown_idx": 1,
    "target_idx": 2, "category": "punctuality", "template_id": "fairness.punctuality.0",
}
QA = {
    "task": "hallucination", "source": "synthetic", "context": "Kelby makes ink.", "question": "Who started Kelby?",
    "answer": ABSTENTION, "answerable": False, "distractor": "Mara Venn", "category": "company",
    "template_id": "hallucination.company.founder",
}


def frame_of(*rows: tuple[str, dict]):
    by_split: dict[str, list[RawRow]] = {"train": [], "eval": []}
    for split, data in rows:
        by_split[split].append(RawRow(f"{split}.jsonl", len(by_split[split]) + 1, data))
    return build_frame(by_split)


def train_row(fields: dict) -> dict:
    (record,) = apply_sft_noise([make_record(fields, "train")], 0.0, seed=0)
    return record.model_dump(mode="json")


def test_clean_rows_hold_true_in_every_applicable_check():
    frame = frame_of(("train", train_row(FAIR)), ("train", train_row(QA)))
    fair, qa = frame.iloc[0], frame.iloc[1]
    for column in ("fair_choices_distinct", "fair_label_in_range", "fair_unknown_idx_matches",
                   "fair_ambig_label_unknown", "fair_answer_is_choice", "sft_consistent", "utf8_ok",
                   "id_matches_content", "split_matches_file"):
        assert fair[column] == True, column  # noqa: E712 (numpy bool)
    assert fair["fair_unknown_options"] == 1 and fair["schema_types"] == "" and fair["fair_missing"] == ""
    assert qa["hall_abstains"] and qa["hall_distractor_not_in_context"] and qa["hall_missing"] == ""
    assert pd.isna(qa["hall_answer_in_context"])  # not answerable: the rule skips the row
    assert not fair["id_leak"] and not qa["text_leak"]


@pytest.mark.parametrize(
    ("change", "column", "expected"),
    [
        # a change to the fairness row, the derived column, its value
        ({"label": 0, "answer": "The Velorian nurse"}, "fair_ambig_label_unknown", False),
        ({"choices": ["Unknown", "Unknown", "The Brasken nurse"]}, "fair_choices_distinct", False),
        ({"choices": ["Not known", "Unknown", "The Brasken nurse"]}, "fair_unknown_options", 2),
        ({"target_idx": 1}, "fair_target_idx_in_range", False),
        ({"answer": "The Brasken nurse"}, "fair_answer_is_choice", False),
        ({"label": True}, "schema_types", "label is bool"),
        ({"label": None}, "fair_missing", "label"),
        # options the parser cannot tell apart: equal up to case, punctuation and articles
        ({"choices": ["The Velorian nurse", "Unknown", "velorian nurse."]}, "fair_choices_distinct", False),
    ],
)
def test_fairness_defects_show_in_their_column(change, column, expected):
    frame = frame_of(("eval", {**make_record(FAIR, "eval").model_dump(mode="json"), **change}))
    assert frame.iloc[0][column] == expected


def test_squad_distractors_may_sit_in_the_context():
    inside = {**QA, "distractor": "ink"}
    synthetic = frame_of(("eval", make_record(inside, "eval").model_dump(mode="json"))).iloc[0]
    squad = frame_of(("eval", make_record({**inside, "source": "squad2"}, "eval").model_dump(mode="json"))).iloc[0]
    assert synthetic["hall_distractor_not_in_context"] == False  # noqa: E712 (numpy bool)
    assert pd.isna(squad["hall_distractor_not_in_context"])


def test_leakage_marks_both_copies():
    row = make_record(QA, "eval").model_dump(mode="json")
    frame = frame_of(("eval", row), ("train", train_row(QA)), ("train", train_row(FAIR)))
    leaks = {(split, task): (a, b) for split, task, a, b in
             zip(frame["split"], frame["task"], frame["id_leak"], frame["text_leak"], strict=True)}
    assert leaks == {("eval", "hallucination"): (True, True), ("train", "hallucination"): (True, True),
                     ("train", "fairness"): (False, False)}


def test_choices_and_aliases_are_scanned_for_slots_and_control_characters():
    fair = {**make_record(FAIR, "eval").model_dump(mode="json"), "choices": ["{name}", "Unknown", "Bell\x07"]}
    qa = {**make_record(QA, "eval").model_dump(mode="json"), "aliases": ["[[NAME1]] Venn"]}
    scanned = frame_of(("eval", fair), ("eval", qa))["all_text"]
    assert "{name}" in scanned[0] and "Bell\x07" in scanned[0] and "[[NAME1]] Venn" in scanned[1]


ANSWERABLE = {**QA, "context": "Kelby makes ink. Mara Venn started Kelby at a party.", "answer": "Mara Venn",
              "answerable": True, "aliases": ["M. Venn"], "distractor": "Ola Brandt"}


@pytest.mark.parametrize(
    ("change", "column", "expected"),
    [
        # a change to an answerable row, the derived column, its value
        ({"distractor": "m venn"}, "hall_distractor_not_gold", False),  # an alias, up to case and punctuation
        ({"answer": "art"}, "hall_answer_in_context", False),  # inside "party", not a span of whole words
        ({"answer": "mara venn."}, "hall_answer_in_context", True),  # the span, up to case and punctuation
    ],
)
def test_hallucination_defects_show_in_their_column(change, column, expected):
    frame = frame_of(("eval", {**make_record(ANSWERABLE, "eval").model_dump(mode="json"), **change}))
    assert frame.iloc[0][column] == expected


def test_sft_noise_is_consistent_only_on_ambiguous_items():
    # On a disambiguated item the context names the answer: teaching the biased option there is no noise
    disambiguated = {**FAIR, "context_condition": "disambig", "label": 0, "answer": "The Velorian nurse"}
    row = {**train_row(disambiguated), "sft_label": 2}  # the biased option of a negative question
    assert frame_of(("train", row)).iloc[0]["sft_consistent"] == False  # noqa: E712 (numpy bool)
    noised = {**train_row(FAIR), "sft_label": 2}
    assert frame_of(("train", noised)).iloc[0]["sft_consistent"] == True  # noqa: E712 (numpy bool)
