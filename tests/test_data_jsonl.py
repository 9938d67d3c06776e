"""grpo/data/jsonl.py: atomic writes, and reads that name the bad line."""

from __future__ import annotations

import json

import pytest

from grpo.data.errors import DataValidationError
from grpo.data.jsonl import load_records, read_records, read_rows, records_text
from grpo.data.schema import make_record
from grpo.files import write_atomically

ROW = {"task": "hallucination", "source": "synthetic", "context": "Kelby makes ink.", "question": "What?",
       "answer": "ink", "answerable": True, "category": "company", "template_id": "hallucination.company.goods"}


def test_read_rows_names_each_bad_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"a": 1}\n{broken\n"a string"\n\xff\xfe{"a": 2}\n  \t\n{"b": 3}\n')
    rows, problems = read_rows(path)
    assert [row.line for row in rows] == [1, 6]  # line 5, blanks only, is no row and no problem
    assert [(p.rule, p.line) for p in problems] == [("read.json", 2), ("read.not_object", 3), ("read.utf8", 4)]
    assert all(p.file == str(path) for p in problems)
    _, missing = read_rows(tmp_path / "none.jsonl")
    assert [(p.rule, p.line) for p in missing] == [("read.missing_file", 0)]  # line 0: the file, not a line of it


def test_load_records_round_trip_and_errors(tmp_path):
    record = make_record(ROW, "train")
    path = tmp_path / "train.jsonl"
    write_atomically({path: records_text([record, record])})
    assert load_records(path) == [record, record]
    assert read_records(path) == [record.model_dump(mode="json")] * 2
    path.write_text(path.read_text() + json.dumps({**record.model_dump(), "label": "x"}) + "\n")
    with pytest.raises(DataValidationError, match=r"train.jsonl:3: field label"):
        load_records(path)
    path.write_text("\n\n" + path.read_text())  # two blank lines first: the bad record is on line 5
    with pytest.raises(DataValidationError, match=r"train.jsonl:5: field label"):
        load_records(path)
    with pytest.raises(DataValidationError, match="grpo prepare"):
        read_records(tmp_path / "missing.jsonl")


def test_a_corrupt_line_among_good_ones_is_an_error_not_a_dropped_record(tmp_path):
    record = make_record(ROW, "train")
    path = tmp_path / "train.jsonl"
    text = records_text([record, record])
    path.write_text(text + "{broken\n" + text)
    with pytest.raises(DataValidationError, match=r"train.jsonl:3: read.json: not valid JSON"):
        load_records(path)
