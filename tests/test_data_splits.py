"""grpo/data/splits.py: group splits, stratified sampling and SFT noise, all seeded."""

from __future__ import annotations

import random
from collections import Counter

from grpo.data.schema import make_record
from grpo.data.splits import apply_sft_noise, assign_groups, stratified_sample
from grpo.data.synthetic_fairness import generate_fairness
from grpo.data.synthetic_grounded import generate_grounded


def test_assign_groups_is_seeded_and_keeps_both_splits():
    keys = [f"t{i}" for i in range(10)]
    split = assign_groups(keys, 0.3, seed=1)
    assert split == assign_groups(list(reversed(keys)), 0.3, seed=1)
    assert Counter(split.values()) == {"train": 7, "eval": 3}
    assert split != assign_groups(keys, 0.3, seed=2)
    assert set(assign_groups(["a", "b"], 0.01, seed=0).values()) == {"train", "eval"}
    # with three groups a share near 0 or 1 still leaves one group to the other split
    assert Counter(assign_groups(["a", "b", "c"], 0.01, seed=0).values()) == {"train": 2, "eval": 1}
    assert Counter(assign_groups(["a", "b", "c"], 0.99, seed=0).values()) == {"train": 1, "eval": 2}
    assert assign_groups(["a"], 0.99, seed=0) == {"a": "eval"} and assign_groups(["a"], 0.2, seed=0) == {"a": "train"}


def test_stratified_sample_follows_shares_and_fills_shortfalls():
    items = [{"k": "a", "i": i} for i in range(50)] + [{"k": "b", "i": i} for i in range(3)]
    picked = stratified_sample(items, 20, lambda x: x["k"], {"a": 0.5, "b": 0.5}, random.Random(0))
    assert len(picked) == 20 and Counter(x["k"] for x in picked) == {"a": 17, "b": 3}
    again = stratified_sample(items, 20, lambda x: x["k"], {"a": 0.5, "b": 0.5}, random.Random(0))
    assert again == picked
    # each stratum is drawn at random, not its first items: another seed picks other items of "a"
    other = stratified_sample(items, 20, lambda x: x["k"], {"a": 0.5, "b": 0.5}, random.Random(1))
    assert {x["i"] for x in other if x["k"] == "a"} != {x["i"] for x in picked if x["k"] == "a"}
    only_a = stratified_sample(items[:50], 10, lambda x: x["k"], {"a": 1.0}, random.Random(0))
    assert {x["i"] for x in only_a} != set(range(10))
    # a shortfall is filled from every other stratum's leftovers at random, not from the first by name
    spare = items + [{"k": "c", "i": i} for i in range(50)]
    filled = stratified_sample(spare, 20, lambda x: x["k"], {"a": 0.5, "b": 0.5}, random.Random(0))
    assert Counter(x["k"] for x in filled)["c"] > 0
    even = stratified_sample(items[:10] + items[50:], 6, lambda x: x["k"], {"a": 0.5, "b": 0.5}, random.Random(0))
    assert Counter(x["k"] for x in even) == {"a": 3, "b": 3}
    # largest remainders: 7 x (0.3, 0.7) = 2.1 and 4.9 -> 2 and 5; 10 x (0.14, 0.43, 0.43) = 1.4, 4.3, 4.3 -> 2, 4, 4
    plenty = [{"k": k, "i": i} for k in "abc" for i in range(20)]
    uneven = stratified_sample(plenty, 7, lambda x: x["k"], {"a": 0.3, "b": 0.7}, random.Random(0))
    assert Counter(x["k"] for x in uneven) == {"a": 2, "b": 5}
    three = stratified_sample(plenty, 10, lambda x: x["k"], {"a": 0.14, "b": 0.43, "c": 0.43}, random.Random(0))
    assert Counter(x["k"] for x in three) == {"a": 2, "b": 4, "c": 4}


def _records(split="train"):
    fields = generate_fairness(40, split, seed=0) + generate_grounded(40, split, seed=0, answerable_fraction=0.5)
    return [make_record(f, split) for f in fields]


def test_sft_noise_counts_and_targets():
    noised = apply_sft_noise(_records(), 0.25, seed=0)
    ambiguous = [r for r in noised if r.context_condition == "ambig"]
    flipped = [r for r in ambiguous if r.sft_label != r.label]
    assert len(flipped) == 5  # round(0.25 * 20)
    for r in flipped:  # the biased option: target on a negative question, the other person otherwise
        assert r.sft_label != r.unknown_idx
        assert (r.sft_label == r.target_idx) == (r.question_polarity == "neg")
    assert all(r.sft_label == r.label for r in noised if r.context_condition == "disambig")
    unanswerable = [r for r in noised if r.answerable is False]
    assert sum(r.sft_answer == r.distractor for r in unanswerable) == 5
    assert all(r.sft_answer == r.answer for r in noised if r.answerable)
    assert apply_sft_noise(_records(), 0.25, seed=0) == noised
    rounded = apply_sft_noise(_records(), 0.33, seed=0)  # 0.33 x 20 = 6.6: round, never truncate
    assert sum(r.sft_label != r.label for r in rounded if r.context_condition == "ambig") == 7


def test_no_noise_and_eval_records():
    clean = apply_sft_noise(_records(), 0.0, seed=0)
    assert all((r.sft_label if r.task == "fairness" else r.sft_answer) == (r.label if r.task == "fairness"
               else r.answer) for r in clean)
    records = _records("eval")
    evaluation = apply_sft_noise(records, 1.0, seed=0)
    assert evaluation == records  # every eval record kept, in order, unchanged
    assert all(r.sft_label is None and r.sft_answer is None for r in evaluation)
