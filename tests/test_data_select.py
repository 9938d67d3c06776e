"""grpo/data/select.py: which train records SFT and GRPO read (``data.grpo_holdout``)."""

from __future__ import annotations

import pytest

from grpo.config import config_from_dict
from grpo.data.errors import DataSourceError
from grpo.data.jsonl import records_text
from grpo.data.prepare import build_records
from grpo.data.select import balanced_records, held_out_for_grpo, interleave, split_by_task, train_records

RECORDS = {r.id: r for r in build_records(config_from_dict({"data": {"n_train": 2000, "n_eval": 2}}))["train"]}
"""Real prepared train records by id, in prepare's order."""


def _write_train(tmp_path, ids):
    data_dir = tmp_path / "data"
    data_dir.mkdir(exist_ok=True)
    (data_dir / "train.jsonl").write_text(records_text([RECORDS[i] for i in ids]))
    return data_dir


def _cfg(data_dir, share, seed=1234):
    return config_from_dict({"seed": seed, "paths": {"data_dir": str(data_dir)}, "data": {"grpo_holdout": share}})


def test_without_a_holdout_sft_and_grpo_read_every_train_record(tmp_path):
    ids = list(RECORDS)[:50]
    cfg = _cfg(_write_train(tmp_path, ids), 0.0)
    assert [r["id"] for r in train_records(cfg, "sft")] == ids
    assert [r["id"] for r in train_records(cfg, "grpo")] == ids


def test_the_holdout_splits_train_records_into_disjoint_sft_and_grpo_parts(tmp_path):
    ids = list(RECORDS)
    cfg = _cfg(_write_train(tmp_path, ids), 0.25)
    sft, grpo = ([r["id"] for r in train_records(cfg, stage)] for stage in ("sft", "grpo"))
    assert not set(sft) & set(grpo)
    assert sorted(sft + grpo) == sorted(ids)
    assert sft == [i for i in ids if i in set(sft)] and grpo == [i for i in ids if i in set(grpo)]  # file order
    assert 0.22 < len(grpo) / len(ids) < 0.28
    # A record's side depends on its id and the seed only: not on the file order or the other records.
    _write_train(tmp_path, list(reversed(ids[:500])))
    assert {r["id"] for r in train_records(cfg, "grpo")} == set(grpo) & set(ids[:500])
    other_seed = {i for i in ids if held_out_for_grpo(i, 99, 0.25)}
    assert other_seed != set(grpo)


def test_a_holdout_that_leaves_a_stage_nothing_is_an_error_naming_the_param(tmp_path):
    only = next(iter(RECORDS))
    cfg = _cfg(_write_train(tmp_path, [only]), 0.5)
    stage = "grpo" if held_out_for_grpo(only, 1234, 0.5) else "sft"
    empty = "sft" if stage == "grpo" else "grpo"
    assert [r["id"] for r in train_records(cfg, stage)] == [only]
    toward = "0" if empty == "grpo" else "1"  # GRPO's share shrinks toward 0, SFT's toward 1
    with pytest.raises(DataSourceError, match=f"data.grpo_holdout=0.5 leaves no train record for {empty}; raise"
                                              f".* away from {toward}$"):
        train_records(cfg, empty)


def test_a_missing_or_empty_train_split_is_an_error_naming_the_fix(tmp_path):
    with pytest.raises(DataSourceError, match="no train split; run `grpo prepare`"):
        train_records(_cfg(tmp_path / "none", 0.0), "sft")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("")
    with pytest.raises(DataSourceError, match="holds no record; check data.n_train"):
        train_records(_cfg(empty, 0.25), "grpo")


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_the_holdout_is_a_share_below_one(share):
    with pytest.raises(ValueError, match="grpo_holdout"):
        config_from_dict({"data": {"grpo_holdout": share}})


def test_records_are_grouped_by_task_in_file_order():
    records = [{"task": t, "i": i} for i, t in enumerate(["hallucination", "fairness", "fairness"])]
    assert split_by_task(records) == {"fairness": [records[1], records[2]], "hallucination": [records[0]]}
    assert split_by_task([]) == {"fairness": [], "hallucination": []}


def test_interleave_alternates_then_takes_the_rest_up_to_the_limit():
    a, b = [f"a{i}" for i in range(4)], ["b0"]
    assert interleave([a, b]) == ["a0", "b0", "a1", "a2", "a3"]
    assert interleave([a, b], limit=3) == ["a0", "b0", "a1"]
    assert interleave([a, ["b0", "b1"]], limit=3) == ["a0", "b0", "a1"]  # the limit cuts a round short
    assert interleave([a, b], limit=0) == [] and interleave([[], []]) == []
    assert interleave([[], b], limit=5) == ["b0"]
    assert a == [f"a{i}" for i in range(4)]  # the groups are left as they were


def test_a_cap_on_the_records_keeps_both_tasks():
    records = [{"task": "fairness", "i": i} for i in range(6)] + [{"task": "hallucination", "i": 0}]
    picked = balanced_records(records, 3)
    assert [(r["task"], r["i"]) for r in picked] == [("fairness", 0), ("hallucination", 0), ("fairness", 1)]
