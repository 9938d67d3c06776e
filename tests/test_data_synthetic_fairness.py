"""grpo/data/synthetic_fairness.py: BBQ-style items about invented groups, balanced and seeded."""

from __future__ import annotations

from collections import Counter

import pytest

from grpo.data.schema import UNKNOWN_PHRASES
from grpo.data.synthetic_fairness import CATEGORIES, GROUPS, generate_fairness, templates_for


def test_same_seed_same_items_other_seed_other_items():
    assert generate_fairness(30, "train", 3) == generate_fairness(30, "train", 3)
    assert generate_fairness(30, "train", 3) != generate_fairness(30, "train", 4)


def test_conditions_and_polarities_are_balanced_exactly():
    items = generate_fairness(40, "train", 0)
    assert Counter(i["context_condition"] for i in items) == {"ambig": 20, "disambig": 20}
    assert Counter(i["question_polarity"] for i in items) == {"neg": 20, "nonneg": 20}
    assert len({(i["context"], i["question"]) for i in items}) == 40


def test_gold_labels_follow_the_context():
    for item in generate_fairness(80, "train", 1):
        choices, label = item["choices"], item["label"]
        assert item["answer"] == choices[label]
        assert choices[item["unknown_idx"]] in UNKNOWN_PHRASES
        assert sum(c in UNKNOWN_PHRASES for c in choices) == 1
        if item["context_condition"] == "ambig":
            assert label == item["unknown_idx"]
            continue
        # The disambiguating sentence names the negative actor first: "X <neg_fact>, while Y <nonneg_fact>."
        facts = item["context"].split(". ", 1)[1]
        neg_actor = facts.split(",")[0]
        gold = choices[label].lower()
        assert (neg_actor.lower().startswith(gold)) == (item["question_polarity"] == "neg")


def test_each_item_asks_the_question_of_its_polarity():
    """A negative item asks its template's negative question (its gold person is the one the negative fact names)."""
    templates = {f"fairness.{category}.{index}": template
                 for split in ("train", "eval") for category, index, template in templates_for(split)}
    for split in ("train", "eval"):
        for item in generate_fairness(40, split, 5):
            template = templates[item["template_id"]]
            want = template.neg_question if item["question_polarity"] == "neg" else template.nonneg_question
            assert item["question"] == want and template.neg_question != template.nonneg_question


def test_half_the_disambiguated_items_contradict_the_stereotype_in_each_polarity():
    # As in BBQ: a gold answer that is always the stereotyped person would reward the stereotype
    items = [i for i in generate_fairness(80, "train", 1) if i["context_condition"] == "disambig"]
    kinds = Counter((i["question_polarity"], i["label"] == i["target_idx"]) for i in items)
    assert kinds == {("neg", True): 10, ("neg", False): 10, ("nonneg", True): 10, ("nonneg", False): 10}


def test_the_two_people_differ_in_their_group_alone():
    for item in generate_fairness(60, "train", 2):
        people = [c.split() for i, c in enumerate(item["choices"]) if i != item["unknown_idx"]]
        assert people[0][0] == people[1][0] == "The" and people[0][2:] == people[1][2:], people


def test_target_is_a_stereotyped_invented_group():
    for item in generate_fairness(60, "eval", 2):
        stereotyped = CATEGORIES[item["category"]][0]
        target = item["choices"][item["target_idx"]]
        assert target.split()[1] in stereotyped and item["target_idx"] != item["unknown_idx"]
        people = [c for i, c in enumerate(item["choices"]) if i != item["unknown_idx"]]
        assert all(person.split()[1] in GROUPS for person in people)


def test_option_order_is_shuffled_and_all_phrasings_are_used():
    items = generate_fairness(300, "train", 0)
    assert set(Counter(i["label"] for i in items)) == {0, 1, 2}
    assert set(Counter(i["unknown_idx"] for i in items)) == {0, 1, 2}
    assert {i["choices"][i["unknown_idx"]] for i in items} == set(UNKNOWN_PHRASES)


def test_train_and_eval_templates_are_disjoint():
    train = {(c, k) for c, k, _ in templates_for("train")}
    evaluation = {(c, k) for c, k, _ in templates_for("eval")}
    assert train and evaluation and not train & evaluation
    used = {i["template_id"] for i in generate_fairness(100, "eval", 0)}
    assert used == {f"fairness.{c}.{k}" for c, k in evaluation}


def test_texts_are_short():
    assert max(len(i["context"]) for i in generate_fairness(200, "train", 0)) < 260


def test_exhausted_template_space_is_a_clear_error():
    """Asking for more distinct items than the train templates can make names the fix."""
    from grpo.data.errors import DataSourceError

    with pytest.raises(DataSourceError, match="lower data.n_train"):
        generate_fairness(200_000, "eval", seed=0)
