"""grpo/data/report.py: rule results become JSON, a readable summary and an error naming rule, file and rows."""

from __future__ import annotations

import json

import great_expectations.expectations as gxe
import pandas as pd

from grpo.config import config_from_dict
from grpo.data import validate
from grpo.data.jsonl import ReadProblem
from grpo.data.report import (
    RuleResult,
    ValidationReport,
    failure_message,
    gx_results,
    read_results,
    to_json,
    to_markdown,
)

BROKEN = RuleResult("fairness.ambig_label_unknown", "fair_ambig_label_unknown", "expect_column_values_to_be_in_set",
                    False, 40, 1, None, [{"file": "data/train.jsonl", "line": 7, "id": "abc", "value": False}], None)
PASSED = RuleResult("required.id", "id", "expect_column_values_to_not_be_null", True, 40, 0, None, [], None)


def test_read_problems_are_grouped_by_rule_with_lines():
    problems = [ReadProblem("read.json", "t.jsonl", 3, "bad"), ReadProblem("read.json", "t.jsonl", 9, "bad"),
                ReadProblem("read.utf8", "e.jsonl", 2, "bytes")]
    results = read_results(problems, max_examples=1)
    assert [(r.rule, r.unexpected_count, len(r.examples)) for r in results] == [("read.json", 2, 1),
                                                                               ("read.utf8", 1, 1)]
    assert not any(r.success for r in results)


def test_reports_and_message_name_rule_file_and_row():
    report = ValidationReport(["data/train.jsonl"], 40, [PASSED, BROKEN])
    assert not report.success and report.failures == [BROKEN]
    payload = json.loads(to_json(report))
    assert payload["failed_rules"] == ["fairness.ambig_label_unknown"] and payload["n_failed"] == 1
    markdown = to_markdown(report)
    assert "FAILED (1 of 2 rules)" in markdown and "data/train.jsonl:7" in markdown
    message = failure_message(report, "reports/validation.md")
    assert "fairness.ambig_label_unknown" in message.splitlines()[0]  # the line a failed run leads with
    assert "required.id" not in message  # a rule that passed is no reason of the failure
    assert "data/train.jsonl:7 (id abc)" in message
    assert "reports/validation.md" in message and "grpo prepare" in message


def test_a_rule_that_could_not_run_is_a_failure_with_its_error(monkeypatch):
    frame = pd.DataFrame({"_file": ["train.jsonl"], "_line": [1], "present": [True]})
    broken = gxe.ExpectColumnValuesToBeInSet(column="absent", value_set=[True], meta={"rule": "demo.absent"})
    monkeypatch.setattr(validate, "build_expectations", lambda frame, cfg: [broken])
    (rule,) = gx_results(validate.run_suite(frame, config_from_dict({})), frame, max_examples=3)
    assert rule.rule == "demo.absent" and rule.success is False
    assert rule.error == 'Error: The column "absent" in BatchData does not exist.'  # GX's, once per rule
    assert f"could not run: {rule.error}" in to_markdown(ValidationReport(["train.jsonl"], 1, [rule]))
