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
        # an index one past the three options, or before them, is out of range
        ({"label": 3}, "fair_label_in_range", False),
        ({"label": -1}, "fair_label_in_range", False),
        ({"unknown_idx": 3}, "fair_unknown_idx_in_range", False),
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


@pytest.mark.parametrize(
    ("base", "change", "expected"),
    [
        # a row, a change, what schema_types says of it
        (QA, {"aliases": "M. Venn"}, "aliases is not a list of strings"),
        (QA, {"aliases": ["M. Venn", 3]}, "aliases is not a list of strings"),
        (FAIR, {"choices": ["The Velorian nurse", "Unknown", None]}, "choices is not a list of strings"),
        (QA, {"answerable": "no"}, "answerable is str"),
        (QA, {"context": 5}, "context is int"),
    ],
)
def test_wrong_types_are_named_in_schema_types(base, change, expected):
    row = frame_of(("eval", {**make_record(base, "eval").model_dump(mode="json"), **change})).iloc[0]
    assert row["schema_types"] == expected


def test_a_wrongly_typed_text_is_kept_out_of_the_text_checks():
    row = frame_of(("eval", {**make_record(QA, "eval").model_dump(mode="json"), "context": 5})).iloc[0]
    assert row["context"] is None and row["text_hash"] is None and "context" not in row["all_text"]
    question = frame_of(("eval", {**make_record(QA, "eval").model_dump(mode="json"), "question": None})).iloc[0]
    assert question["text_hash"] is None  # a hash needs both the context and the question


def test_an_id_that_cannot_be_recomputed_does_not_match():
    data = make_record(QA, "eval").model_dump(mode="json")
    del data["answer"]
    assert frame_of(("eval", data)).iloc[0]["id_matches_content"] == False  # noqa: E712 (numpy bool)


def test_an_empty_option_is_not_distinct():
    data = {**make_record(FAIR, "eval").model_dump(mode="json"), "choices": ["", "Unknown", "The Brasken nurse"]}
    row = frame_of(("eval", data)).iloc[0]
    assert row["fair_choices_distinct"] == False and row["choice_len_max"] == len("The Brasken nurse")  # noqa: E712


def test_an_unanswerable_row_needs_its_distractor():
    unanswerable = {**make_record(QA, "eval").model_dump(mode="json"), "distractor": None}
    answerable = {**make_record(ANSWERABLE, "eval").model_dump(mode="json"), "distractor": None}
    frame = frame_of(("eval", unanswerable), ("eval", answerable))
    assert list(frame["hall_missing"]) == ["distractor", ""]


def test_the_balance_columns_hold_each_rows_share():
    """The suite's balance expectations average these columns per split: one row of each task here."""
    frame = frame_of(("train", train_row(FAIR)), ("train", train_row(QA)))
    fair, qa = frame.iloc[0], frame.iloc[1]
    assert (fair["is_fairness_train"], fair["ambig_train"], fair["neg_train"]) == (1.0, 1.0, 1.0)
    assert (fair["label0_train"], fair["label1_train"], fair["label2_train"]) == (0.0, 1.0, 0.0)
    assert (fair["is_train"], fair["is_eval"]) == (1.0, 0.0)
    assert (qa["is_fairness_train"], qa["answerable_train"], qa["is_train"]) == (0.0, 0.0, 1.0)
    assert pd.isna(qa["ambig_train"]) and pd.isna(qa["label1_train"]) and pd.isna(fair["answerable_train"])
    disambiguated = {**FAIR, "context_condition": "disambig", "question_polarity": "nonneg", "label": 0,
                     "answer": "The Velorian nurse"}
    row = frame_of(("eval", make_record(disambiguated, "eval").model_dump(mode="json"))).iloc[0]
    assert (row["ambig_eval"], row["neg_eval"], row["label0_eval"], row["is_eval"]) == (0.0, 0.0, 1.0, 1.0)


def _eval_row(base: dict, **change) -> pd.Series:
    return frame_of(("eval", {**make_record(base, "eval").model_dump(mode="json"), **change})).iloc[0]


def test_a_lone_surrogate_is_not_utf8():
    assert _eval_row(QA)["utf8_ok"] == True  # noqa: E712 (numpy bool)
    assert _eval_row(QA, question="Who started \ud800Kelby?")["utf8_ok"] == False  # noqa: E712
    assert _eval_row(QA, aliases=["\udcff"])["utf8_ok"] == False  # noqa: E712


def test_a_disambiguated_label_must_name_a_person():
    disambiguated = {**FAIR, "context_condition": "disambig", "label": 0, "answer": "The Velorian nurse"}
    assert _eval_row(disambiguated)["fair_disambig_label_known"] == True  # noqa: E712
    assert _eval_row(disambiguated, label=1, answer="Unknown")["fair_disambig_label_known"] == False  # noqa: E712
    assert _eval_row(FAIR)["fair_disambig_label_known"] is None  # ambiguous: the rule does not apply


def test_a_hallucination_row_has_no_options_or_option_indices():
    assert _eval_row(QA)["hall_no_choices"] == True  # noqa: E712
    assert _eval_row(QA, choices=["a", "b", "c"])["hall_no_choices"] == False  # noqa: E712
    assert _eval_row(QA, target_idx=0)["hall_no_choices"] == False  # noqa: E712


def test_abstention_and_distractor_rules_of_an_unanswerable_row():
    assert _eval_row(QA)["hall_abstains"] == True  # noqa: E712
    assert _eval_row(QA, answer="Mara Venn")["hall_abstains"] == False  # noqa: E712
    assert _eval_row(ANSWERABLE)["hall_abstains"] is None
    assert _eval_row(ANSWERABLE)["hall_distractor_not_gold"] == True  # noqa: E712
    assert _eval_row(ANSWERABLE, distractor=ABSTENTION)["hall_distractor_not_gold"] == False  # noqa: E712


def _sft_row(base: dict, **change) -> pd.Series:
    return frame_of(("train", {**train_row(base), **change})).iloc[0]


def test_the_sft_targets_are_checked_against_the_noise_they_may_carry():
    # fairness: noise teaches the biased option of an ambiguous item only
    assert _sft_row(FAIR)["sft_noised_fair"] == 0.0 and _sft_row(FAIR, sft_label=2)["sft_noised_fair"] == 1.0
    assert _sft_row(FAIR, target_idx=3, sft_label=3)["sft_consistent"] == False  # noqa: E712 (no biased option)
    disambiguated = {**FAIR, "context_condition": "disambig", "label": 0, "answer": "The Velorian nurse"}
    assert pd.isna(_sft_row(disambiguated)["sft_noised_fair"])
    # hallucination: an unanswerable item's target may be its distractor, nothing else
    assert (_sft_row(QA)["sft_consistent"], _sft_row(QA)["sft_noised_hall"]) == (True, 0.0)
    noised = _sft_row(QA, sft_answer="Mara Venn")
    assert (noised["sft_consistent"], noised["sft_noised_hall"]) == (True, 1.0)
    assert _sft_row(QA, sft_answer="Ola Brandt")["sft_consistent"] == False  # noqa: E712
    wrong = _sft_row(ANSWERABLE, sft_answer="Ola Brandt")
    assert wrong["sft_consistent"] == False and pd.isna(wrong["sft_noised_hall"])  # noqa: E712
    assert pd.isna(_sft_row(ANSWERABLE)["sft_noised_hall"]) and _sft_row(ANSWERABLE)["sft_consistent"] == True  # noqa: E712


def test_sft_fields_belong_to_train_records_only():
    assert _eval_row(FAIR, sft_label=1)["sft_fields"] == "sft_label on an eval record"
    assert _eval_row(QA)["sft_fields"] == ""
    other = frame_of(("eval", {**make_record(FAIR, "eval").model_dump(mode="json"), "split": "dev"}))
    assert "sft_fields" not in other and not other.iloc[0]["split_matches_file"]


def test_a_row_of_no_known_task_adds_no_balance_and_there_are_three_labels():
    frame = frame_of(("train", train_row(FAIR)), ("eval", {**make_record(QA, "eval").model_dump(mode="json"),
                                                            "task": "summary"}))
    assert "is_fairness_eval" not in frame and "label3_train" not in frame
