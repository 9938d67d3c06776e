"""grpo/data/synthetic_grounded.py: answerable spans, unanswerable abstentions with outside distractors."""

from __future__ import annotations

from grpo.data.schema import ABSTENTION
from grpo.data.synthetic_grounded import NAME_PARTS, TYPES, generate_grounded
from grpo.data.text import contains


def test_same_seed_same_items_other_seed_other_items():
    assert generate_grounded(30, "train", 3, 0.5) == generate_grounded(30, "train", 3, 0.5)
    assert generate_grounded(30, "train", 3, 0.5) != generate_grounded(30, "train", 4, 0.5)


def test_answers_are_spans_and_unanswerables_abstain():
    items = generate_grounded(200, "train", 0, 0.5)
    assert sum(i["answerable"] for i in items) == 100
    for item in items:
        assert not contains(item["context"], item["distractor"])
        assert item["distractor"] != item["answer"]
        if item["answerable"]:
            assert contains(item["context"], item["answer"])
        else:
            assert item["answer"] == ABSTENTION and item["aliases"] == []
        assert 1 <= item["context"].count(".") <= 3 and len(item["context"]) < 200


def test_an_unanswerable_context_never_states_the_asked_fact():
    """Its sentences are the entity's other facts: the asked attribute's sentence is not among them (else the
    gold "I don't know" would be wrong where the context answers)."""
    unanswerable = [i for i in generate_grounded(200, "train", 0, 0.5) if not i["answerable"]]
    assert len(unanswerable) == 100
    for item in unanswerable:
        _, kind, name = item["template_id"].split(".")
        asked = next(a for a in TYPES[kind] if a.name == name)
        stem = asked.sentence.split("{v}")[0].split("{e}")[1]  # " was started in "
        assert stem not in item["context"], (item["question"], item["context"])


def test_answerable_fraction_holds_for_every_prefix():
    items = generate_grounded(40, "eval", 0, 0.25)
    assert sum(i["answerable"] for i in items) == 10
    assert sum(i["answerable"] for i in items[:8]) == 2


def test_train_and_eval_entity_names_are_disjoint():
    for kind in NAME_PARTS["train"]:
        for part in range(2):
            assert not set(NAME_PARTS["train"][kind][part]) & set(NAME_PARTS["eval"][kind][part])
    train = {i["question"] for i in generate_grounded(200, "train", 0, 0.5)}
    evaluation = {i["question"] for i in generate_grounded(100, "eval", 0, 0.5)}
    assert not train & evaluation


def test_the_answering_sentence_sits_anywhere_in_the_context():
    # A context whose last sentence always answers would teach a position instead of reading
    positions = []
    for item in generate_grounded(200, "train", 0, 0.5):
        sentences = [s for s in item["context"].split(". ") if s]
        if item["answerable"] and len(sentences) > 1:
            positions.append(contains(sentences[-1], item["answer"]))
    assert len(positions) > 40 and 0.2 < sum(positions) / len(positions) < 0.8
