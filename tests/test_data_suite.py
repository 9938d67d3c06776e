"""grpo/data/suite.py: balance bounds, and a named expectation for every documented rule."""

from __future__ import annotations

import re

import pytest

from grpo.config import DataChecksConfig, config_from_dict
from grpo.data import suite
from grpo.data.jsonl import RawRow
from grpo.data.prepare import build_records
from grpo.data.rules import build_frame


@pytest.mark.parametrize(
    ("target", "n", "expected"),
    [
        # target share, rows, accepted range (tolerance 0.1, z 3)
        (0.5, 10_000, (0.4, 0.6)),  # large n: the tolerance
        (0.5, 25, (0.2, 0.8)),  # small n: three standard errors, 3 * sqrt(0.25 / 25) = 0.3
        (1.0, 5, (0.9, 1.0)),  # clipped to [0, 1]
    ],
)
def test_share_bounds(target, n, expected):
    low, high = suite.share_bounds(target, n, DataChecksConfig())
    assert low == pytest.approx(expected[0]) and high == pytest.approx(expected[1])


def test_every_documented_rule_has_an_expectation():
    cfg = config_from_dict({"data": {"n_train": 40, "n_eval": 20}})
    by_split = build_records(cfg)
    rows = {split: [RawRow(f"{split}.jsonl", i + 1, r.model_dump(mode="json")) for i, r in enumerate(records)]
            for split, records in by_split.items()}
    expectations = suite.build_expectations(build_frame(rows), cfg)
    names = {e.meta["rule"] for e in expectations}
    documented = set(re.findall(r"``([a-z_<>]+\.[a-z_.<>]+)``", suite.__doc__))
    assert len(documented) > 30
    for pattern in documented:  # <split>, <field>, <task> stand for any name
        regex = re.escape(pattern).replace(re.escape("<"), "<").replace(re.escape(">"), ">")
        regex = re.sub(r"<[a-z]+>", "[a-z_]+", regex)
        assert any(re.fullmatch(regex, name) for name in names), pattern
    for split in ("train", "eval"):
        assert {f"balance.ambig.{split}", f"balance.task_mix.{split}", f"count.{split}"} <= names


def test_the_balance_rules_aim_at_the_configured_shares():
    cfg = config_from_dict({"data": {"n_train": 40, "n_eval": 20, "answerable_fraction": 0.25,
                                     "fairness_fraction": 0.6}})
    by_split = build_records(cfg)
    rows = {split: [RawRow(f"{split}.jsonl", i + 1, r.model_dump(mode="json")) for i, r in enumerate(records)]
            for split, records in by_split.items()}
    frame = build_frame(rows)
    rules = {e.meta["rule"]: e for e in suite.build_expectations(frame, cfg)}
    checks = cfg.data.checks
    for split in ("train", "eval"):
        for name, column, target in (("answerable", "answerable", 0.25), ("task_mix", "is_fairness", 0.6)):
            rule = rules[f"balance.{name}.{split}"]
            n = suite._count(frame, f"{column}_{split}")
            assert (rule.min_value, rule.max_value) == suite.share_bounds(target, n, checks), (name, split)
        count, n = rules[f"count.{split}"], {"train": cfg.data.n_train, "eval": cfg.data.n_eval}[split]
        assert (count.min_value, count.max_value) == (n, n)
