"""grpo/data/validation.py: GRPO's validation split, equal shares of each kind, a function of seed and ids."""

from __future__ import annotations

import random

from grpo.data.kinds import record_kind
from grpo.data.validation import validation_split


def records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 2:
            out.append({"id": f"f{i}", "task": "fairness", "context_condition": "ambig" if i % 4 == 1 else "disambig"})
        else:
            out.append({"id": f"h{i}", "task": "hallucination", "answerable": i % 4 == 0})
    return out


def test_equal_shares_of_each_kind_and_nothing_lost():
    pool = records(40)
    train, validation = validation_split(pool, 8, seed=3)
    assert sorted(record_kind(r) for r in validation) == sorted(
        ["ambiguous", "disambiguated", "answerable", "unanswerable"] * 2
    )
    assert len(train) + len(validation) == 40 and not {r["id"] for r in train} & {r["id"] for r in validation}
    assert train == [r for r in pool if r not in validation]  # the rest in file order


def test_the_split_depends_on_seed_and_ids_never_on_order():
    pool = records(40)
    shuffled = random.Random(0).sample(pool, len(pool))
    ids = {r["id"] for r in validation_split(pool, 6, seed=3)[1]}
    assert ids == {r["id"] for r in validation_split(shuffled, 6, seed=3)[1]}
    assert ids != {r["id"] for r in validation_split(pool, 6, seed=4)[1]}


KINDS = ("ambiguous", "disambiguated", "answerable", "unanswerable")


def test_a_count_that_does_not_divide_by_the_kinds_is_set_aside_whole():
    for n in (6, 7, 9):  # 4 kinds: the remainder goes one each to the first kinds
        validation = validation_split(records(40), n, seed=3)[1]
        assert len(validation) == n
        counts = [sum(record_kind(r) == kind for r in validation) for kind in KINDS]
        assert max(counts) - min(counts) <= 1, counts


def test_a_kind_with_too_few_gives_what_it_has():
    pool = records(40) + [{"id": "x", "task": "fairness", "context_condition": "ambig"}]
    few = [r for r in pool if record_kind(r) != "answerable"][:3] + [r for r in pool if record_kind(r) == "answerable"][:1]
    train, validation = validation_split(few, 8, seed=0)
    assert train == [] and len(validation) == 4
    assert validation_split([], 8, seed=0) == ([], [])


def test_one_record_set_aside_none_asked_and_none_to_give():
    """``n`` 1 sets one record aside (of the first kind by name); ``n`` 0 none; no records give none."""
    pool = records(40)
    train, validation = validation_split(pool, 1, seed=3)
    assert [record_kind(r) for r in validation] == ["ambiguous"] and len(train) == 39
    assert validation_split(pool, 0, seed=3) == (pool, [])
    assert validation_split([], 4, seed=3) == ([], [])
