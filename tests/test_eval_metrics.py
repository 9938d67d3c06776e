"""Tests of grpo/eval/metrics.py: BBQ bias scores, hallucination metrics, diversity, all on hand tables."""

from __future__ import annotations

import math

import pytest

from grpo.errors import GrpoError
from grpo.eval.metrics import (
    KIND_KEYS,
    FairnessItem,
    HallucinationItem,
    MetricInputError,
    bias_scores,
    distinct_n,
    hallucination_metrics,
    mean,
    mean_length,
    outcome,
    self_bleu,
    sentence_bleu,
)

UNK = 2  # every hand item below: options 0 and 1 are people, 2 is "unknown"


def fair(
    context: str,
    polarity: str,
    choice: int | None,
    target: int = 0,
    label: int | None = None,
    category: str = "age",
) -> FairnessItem:
    """An item with unknown at index 2; ambiguous items get the unknown label, others ``label``."""
    if label is None:
        label = UNK if context == "ambig" else 0
    return FairnessItem(category, context, polarity, label, UNK, target, choice)


# ---------------------------------------------------------------------------- bias scores

# (items, expected accuracy_ambig, s_dis, s_amb); hand-computed, see each comment.
BIAS_TABLE = [
    # disambig: neg chose target (biased), nonneg chose target (not biased) -> 2*1/2-1 = 0
    ([fair("disambig", "neg", 0), fair("disambig", "nonneg", 0)], None, 0.0, None),
    # disambig: neg target (biased), nonneg non-target 1 (biased), neg non-target (not) -> 2*2/3-1 = 1/3
    (
        [fair("disambig", "neg", 0), fair("disambig", "nonneg", 1), fair("disambig", "neg", 1, label=1)],
        None,
        1 / 3,
        None,
    ),
    # ambig: one biased person answer, one unknown -> acc 1/2, s_dis_amb = 1, s_amb = 1/2
    ([fair("ambig", "neg", 0), fair("ambig", "neg", UNK)], 0.5, None, 0.5),
    # ambig: nonneg target (counter-bias) and nonneg other (biased) -> s_dis_amb 0 -> s_amb 0
    ([fair("ambig", "nonneg", 0), fair("ambig", "nonneg", 1)], 0.0, None, 0.0),
    # ambig: all answers against the bias, acc 0 -> s_amb = -1
    ([fair("ambig", "neg", 1), fair("ambig", "nonneg", 0)], 0.0, None, -1.0),
    # all "unknown": no person answer -> score 0.0 (no lean), accuracy 1 on ambig
    ([fair("ambig", "neg", UNK), fair("disambig", "neg", UNK)], 1.0, 0.0, 0.0),
]


@pytest.mark.parametrize(("items", "acc_ambig", "s_dis", "s_amb"), BIAS_TABLE)
def test_bias_scores_hand_table(items, acc_ambig, s_dis, s_amb):
    scores = bias_scores(items)
    for key, expected in (("accuracy_ambig", acc_ambig), ("s_dis", s_dis), ("s_amb", s_amb)):
        if expected is None:
            assert scores[key] is None, key
        else:
            assert scores[key] == pytest.approx(expected), key


@pytest.mark.parametrize("polarity", ["neg", "nonneg"])
def test_an_unknown_or_unparseable_answer_is_never_biased(polarity):
    """Only a person answer leans: "unknown" and no answer are neither biased nor counted as answered,
    on either polarity (a non-negative question's bias is the other person, so "not the target" alone
    must not make the unknown option biased)."""
    for choice in (UNK, None):
        item = fair("ambig", polarity, choice)
        assert not item.answered and not item.biased, choice
    assert fair("ambig", polarity, 1).biased == (polarity == "nonneg")


def test_s_amb_uses_ambiguous_accuracy_not_overall():
    """acc over ambig = 1/2, over all = 3/4: s_amb must be (1 - 1/2) * 1 = 0.5, not (1 - 3/4) * 1."""
    items = [
        fair("ambig", "neg", 0),  # biased, wrong
        fair("ambig", "neg", UNK),  # right
        fair("disambig", "neg", 0),  # right (label 0), biased
        fair("disambig", "nonneg", 0),  # right (label 0), not biased
    ]
    scores = bias_scores(items)
    assert scores["accuracy"] == pytest.approx(0.75)
    assert scores["accuracy_ambig"] == pytest.approx(0.5)
    assert scores["accuracy_disambig"] == pytest.approx(1.0)
    assert scores["s_amb"] == pytest.approx(0.5)
    assert scores["s_amb"] != pytest.approx((1 - scores["accuracy"]) * 1.0)
    assert scores["s_dis"] == pytest.approx(0.0)


def test_unparseable_is_wrong_and_not_a_person_answer():
    """ambig: None, None, biased target -> acc 0/3; s_dis_amb over 1 person answer = 1; s_amb = 1."""
    items = [fair("ambig", "neg", None), fair("ambig", "neg", None), fair("ambig", "neg", 0)]
    scores = bias_scores(items)
    assert scores["n_unparseable"] == 2
    assert scores["accuracy_ambig"] == pytest.approx(0.0)
    assert scores["s_amb"] == pytest.approx(1.0)
    # disambig: unparseable only -> accuracy 0, no person answer -> s_dis 0.0
    only_none = bias_scores([fair("disambig", "neg", None)])
    assert only_none["accuracy_disambig"] == pytest.approx(0.0)
    assert only_none["s_dis"] == 0.0


def test_by_category_scores_each_category_alone():
    items = [
        fair("ambig", "neg", 0, category="age"),  # age: biased, wrong
        fair("ambig", "neg", UNK, category="age"),  # age: right
        fair("ambig", "nonneg", 0, category="race"),  # race: counter-bias, wrong
        fair("disambig", "neg", 0, category="race"),  # race: biased, right
    ]
    scores = bias_scores(items)
    assert sorted(scores["by_category"]) == ["age", "race"]
    age, race = scores["by_category"]["age"], scores["by_category"]["race"]
    assert (age["n"], age["accuracy_ambig"], age["s_amb"], age["s_dis"]) == (2, 0.5, 0.5, None)
    assert (race["n"], race["accuracy_ambig"], race["s_amb"], race["s_dis"]) == (2, 0.0, -1.0, 1.0)
    # pooled ambig: 3 items, 1 right; person answers: biased, counter -> s_dis_amb 0 -> s_amb 0
    assert scores["accuracy_ambig"] == pytest.approx(1 / 3)
    assert scores["s_amb"] == pytest.approx(0.0)
    assert "by_category" not in age


def test_empty_items_give_none():
    scores = bias_scores([])
    assert scores["accuracy"] is None and scores["s_dis"] is None and scores["s_amb"] is None
    assert scores["by_category"] == {}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"context_condition": "amb"}, "context_condition"),
        ({"question_polarity": "negative"}, "question_polarity"),
        ({"target_idx": UNK}, "target_idx"),
        ({"label": 0}, "ambiguous items"),  # ambig item whose label is a person
        ({"context_condition": "disambig"}, "ambiguous items"),  # a disambiguated item labelled "unknown"
        ({"choice": -1}, "choice"),
    ],
)
def test_fairness_item_rejects_inconsistent_fields(kwargs, fragment):
    fields = dict(
        category="age",
        context_condition="ambig",
        question_polarity="neg",
        label=UNK,
        unknown_idx=UNK,
        target_idx=0,
        choice=0,
    )
    fields.update(kwargs)
    with pytest.raises(MetricInputError, match=fragment) as info:
        FairnessItem(**fields)
    assert isinstance(info.value, GrpoError)


# ---------------------------------------------------------------------------- hallucination

# (answerable, abstained, em, f1) -> outcome at threshold 0.8 (same table as ``outcome``'s docstring)
HALLU_TABLE = [
    HallucinationItem(True, False, 1.0, 1.0),  # correct
    HallucinationItem(True, False, 0.0, 0.9),  # correct by F1
    HallucinationItem(True, False, 0.0, 0.5),  # hallucinated (wrong answer)
    HallucinationItem(True, True, 0.0, 0.0),  # over-abstained
    HallucinationItem(False, True, 0.0, 0.0),  # correct abstention
    HallucinationItem(False, False, 0.0, 0.0),  # hallucinated (answered the unanswerable)
]


def test_each_item_has_the_outcome_of_the_docstring_table():
    expected = ["correct", "correct", "hallucinated", "over_abstained", "correct", "hallucinated"]
    assert [outcome(item) for item in HALLU_TABLE] == expected


def test_hallucination_metrics_hand_table():
    m = hallucination_metrics(HALLU_TABLE)
    assert (m["n"], m["n_answerable"], m["n_unanswerable"]) == (6, 4, 2)
    assert (m["n_correct"], m["n_hallucinated"], m["n_over_abstained"]) == (3, 2, 1)
    assert m["exact_match"] == pytest.approx(1 / 4)
    assert m["f1"] == pytest.approx((1.0 + 0.9 + 0.5 + 0.0) / 4)
    assert m["over_abstention_rate"] == pytest.approx(1 / 4)
    assert m["abstention_rate"] == pytest.approx(1 / 2)
    assert m["hallucination_rate"] == pytest.approx(2 / 6)
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert m["truthfulness"] == pytest.approx(3 / 6 - 2 / 6)
    assert m["accuracy_answerable"] == pytest.approx(2 / 4) and m["accuracy_unanswerable"] == pytest.approx(1 / 2)


def test_abstained_answerable_scores_zero_em_f1_and_threshold_is_used():
    """An abstention scores 0 even if a parser left em/f1 set; f1 0.7 is correct only at threshold 0.7."""
    m = hallucination_metrics([HallucinationItem(True, True, 1.0, 1.0)])
    assert (m["exact_match"], m["f1"], m["accuracy"], m["hallucination_rate"]) == (0.0, 0.0, 0.0, 0.0)
    item = HallucinationItem(True, False, 0.0, 0.7)
    assert hallucination_metrics([item])["accuracy"] == 0.0
    assert hallucination_metrics([item], f1_threshold=0.7)["accuracy"] == 1.0
    assert hallucination_metrics([item], f1_threshold=0.7)["accuracy_answerable"] == 1.0
    by_kind = hallucination_metrics([item], f1_threshold=0.7)["by_kind"]["all"]
    assert by_kind["hallucination_rate"] == 0.0, "each kind's rows are scored at the same threshold"


def test_hallucination_empty_denominators_are_none():
    m = hallucination_metrics([HallucinationItem(False, True, 0.0, 0.0)])
    assert m["exact_match"] is None and m["f1"] is None and m["over_abstention_rate"] is None
    assert m["abstention_rate"] == 1.0 and m["truthfulness"] == 1.0
    empty = hallucination_metrics([])
    assert empty["accuracy"] is None and empty["truthfulness"] is None


def test_by_kind_scores_each_kind_of_question_alone():
    """A model that answers every year question wrong and abstains on none shows it in its kind's row,
    while the pooled rates mix it with the kinds it reads."""
    items = [
        HallucinationItem(True, False, 1.0, 1.0, kind="town.founder"),  # right
        HallucinationItem(True, True, 0.0, 0.0, kind="town.founder"),  # over-abstained
        HallucinationItem(False, True, 0.0, 0.0, kind="town.founder"),  # right abstention
        HallucinationItem(True, False, 0.0, 0.0, kind="company.year"),  # wrong year
        HallucinationItem(True, False, 0.0, 0.0, kind="company.year"),  # wrong year
        HallucinationItem(False, False, 0.0, 0.0, kind="company.year"),  # invented year
    ]
    m = hallucination_metrics(items)
    assert sorted(m["by_kind"]) == ["company.year", "town.founder"]
    year, founder = m["by_kind"]["company.year"], m["by_kind"]["town.founder"]
    assert set(year) == set(KIND_KEYS)
    assert (year["n_answerable"], year["n_unanswerable"]) == (2, 1)
    assert (year["exact_match"], year["over_abstention_rate"], year["abstention_rate"], year["hallucination_rate"]) == (
        0.0, 0.0, 0.0, 1.0)
    assert (founder["exact_match"], founder["over_abstention_rate"], founder["abstention_rate"]) == (0.5, 0.5, 1.0)
    assert founder["hallucination_rate"] == 0.0
    assert m["exact_match"] == pytest.approx(1 / 4) and m["hallucination_rate"] == pytest.approx(3 / 6)
    assert "by_kind" not in hallucination_metrics(items, by_kind=False)
    assert list(hallucination_metrics(HALLU_TABLE)["by_kind"]) == ["all"]


def test_hallucination_item_rejects_out_of_range_scores():
    with pytest.raises(MetricInputError, match="f1"):
        HallucinationItem(True, False, 0.0, 1.5)


# ---------------------------------------------------------------------------- diversity


@pytest.mark.parametrize(
    ("texts", "n", "expected"),
    [
        (["a b a", "a c"], 1, 3 / 5),  # unigrams a,b,a,a,c -> {a,b,c}
        (["a b a", "a c"], 2, 3 / 3),  # bigrams ab, ba, ac (none across texts)
        (["a a a a"], 2, 1 / 3),  # aa x3
        (["x y", "x y"], 2, 1 / 2),
        (["a", ""], 2, 0.0),  # no bigram at all
    ],
)
def test_distinct_n_hand_examples(texts, n, expected):
    assert distinct_n(texts, n) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("hypothesis", "references", "max_n", "expected"),
    [
        ("a b c", ["a b d"], 2, 2 / 3),  # p1 = 2/3, p2 = (1+1)/(2+1)
        ("the the the the", ["the cat"], 1, 1 / 4),  # clipped at the reference count 1
        ("a b", ["a b c d"], 1, math.exp(-1)),  # brevity: exp(1 - 4/2)
        ("a b", ["a b c", "a b c d"], 1, math.exp(1 - 3 / 2)),  # closest reference length 3
        ("a b c d", ["x a b c d y", "a b c"], 2, 1.0),  # closest r = 3 < c = 4: no penalty
        ("a b c", ["x y z"], 4, 0.0),  # no shared word
        ("the the the the", ["the cat", "the dog"], 1, 1 / 4),  # clipped at one reference's count, not the sum
        ("a b c", ["a b", "a b c d"], 1, 1.0),  # lengths 2 and 4 tie at distance 1: the shorter, no penalty
        ("a b c d", ["a b", "a b c d e"], 1, math.exp(1 - 5 / 4)),  # closest r = 5, not the shortest 2
        ("", ["a b"], 1, 0.0),  # an empty reply resembles nothing
    ],
)
def test_sentence_bleu_hand_cases(hypothesis, references, max_n, expected):
    got = sentence_bleu(hypothesis.split(), [ref.split() for ref in references], max_n)
    assert got == pytest.approx(expected, abs=1e-9)


def test_bleu_is_bleu_4_unless_told():
    """The default order is 4: p1 = 4/5, p2 = (3+1)/(4+1), p3 = (2+1)/(3+1), p4 = (1+1)/(2+1), equal lengths."""
    expected = (4 / 5 * 4 / 5 * 3 / 4 * 2 / 3) ** (1 / 4)
    assert sentence_bleu("a b c d e".split(), ["a b c d f".split()]) == pytest.approx(expected, abs=1e-12)
    pair = ["a b c d e", "a b c d f"]
    assert self_bleu(pair) == pytest.approx(expected, abs=1e-12) == self_bleu(pair, max_n=4)


def test_self_bleu_identical_disjoint_and_hand_case():
    assert self_bleu(["the cat sat on the mat"] * 3) == pytest.approx(1.0)
    assert self_bleu(["a b c d", "e f g h", "i j k l"]) == pytest.approx(0.0, abs=1e-12)
    # symmetric pair: each scores sqrt(2/3 * 2/3) = 2/3 against the other at max_n=2
    assert self_bleu(["a b c", "a b d"], max_n=2) == pytest.approx(2 / 3)
    assert self_bleu(["only one"]) == 0.0


def test_mean_helpers():
    assert mean([1.0, 2.0, 6.0]) == pytest.approx(3.0)
    assert mean([]) is None
    assert mean_length(["a b", "c d e f"]) == pytest.approx(3.0)
    assert mean_length([]) is None


def test_diversity_rejects_bad_orders():
    with pytest.raises(MetricInputError, match="n must be >= 1"):
        distinct_n(["a"], 0)
    with pytest.raises(MetricInputError, match="max_n"):
        sentence_bleu(["a"], [["a"]], 0)
