"""grpo/data/schema.py: the unified record, its content id and the direction of bias."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from grpo.data.schema import ABSTENTION, LETTERS, UNKNOWN_PHRASES, Record, biased_idx, content_id, make_record

FAIR = {
    "task": "fairness", "source": "synthetic", "context": "A and B met.", "question": "Who was late?",
    "choices": ["The Velorian nurse", "Unknown", "The Brasken nurse"], "label": 1, "answer": "Unknown",
    "context_condition": "ambig", "question_polarity": "neg", "unknown_idx": 1, "target_idx": 2,
    "category": "punctuality", "template_id": "fairness.punctuality.0",
}


def test_constants_other_modules_import():
    assert LETTERS == ("A", "B", "C") and ABSTENTION == "I don't know."
    assert len(UNKNOWN_PHRASES) == len(set(UNKNOWN_PHRASES)) == 10


def test_every_field_is_documented():
    assert [name for name, field in Record.model_fields.items() if not field.description] == []


def test_content_id_is_stable_and_ignores_split():
    train, evaluation = make_record(FAIR, "train"), make_record(FAIR, "eval")
    assert train.id == evaluation.id == content_id("fairness", FAIR["context"], FAIR["question"],
                                                   FAIR["choices"], FAIR["answer"])
    assert len(train.id) == 16 and train.split == "train"
    assert make_record({**FAIR, "question": "Who was early?"}, "train").id != train.id
    swapped = {**FAIR, "choices": ["The Brasken nurse", "Unknown", "The Velorian nurse"], "target_idx": 0}
    assert make_record(swapped, "train").id != train.id, "options in another order: another item"


def test_record_rejects_unknown_fields_and_bad_values():
    with pytest.raises(ValidationError):
        make_record({**FAIR, "lable": 1}, "train")
    with pytest.raises(ValidationError):
        make_record({**FAIR, "task": "sentiment"}, "train")
    with pytest.raises(ValidationError, match="label"):
        make_record({**FAIR, "label": 3}, "train")  # three options: 0, 1, 2
    for index in ("unknown_idx", "target_idx"):
        with pytest.raises(ValidationError, match=index):
            make_record({**FAIR, index: 3}, "train")


def test_a_content_id_is_the_same_in_every_run_of_every_version():
    """Ids outlive a run: the splits, the leak check and GRPO's held-out share hash them, so the id of a
    known item (one with non-ASCII text too) is pinned; a change of its payload re-splits every dataset."""
    assert content_id("fairness", FAIR["context"], FAIR["question"], FAIR["choices"], FAIR["answer"]) == (
        "a92fc4b80f2f1104")
    assert content_id("hallucination", "Zoë lives in Zürich.", "Where does Zoë live?", [], "Zürich") == (
        "c58bad7ae272170a")


@pytest.mark.parametrize(
    ("polarity", "expected"),
    [("neg", 2), ("nonneg", 0)],  # target on a negative question, the other person on a non-negative one
)
def test_biased_idx(polarity, expected):
    assert biased_idx(make_record({**FAIR, "question_polarity": polarity}, "train")) == expected


def test_record_line_is_one_json_object_in_field_order():
    from grpo.data.schema import record_line

    line = record_line(make_record(FAIR, "train"))
    assert line.endswith("\n") and line.count("\n") == 1
    assert list(json.loads(line)) == list(Record.model_fields)
    readable = record_line(make_record({**FAIR, "context": "Zoë and B met in Zürich."}, "train"))
    assert "Zoë and B met in Zürich." in readable, "UTF-8 kept readable, not \\u escapes"
