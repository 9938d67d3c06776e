"""grpo/data/bbq.py on constructed rows: the intersectional labels' parts, the stereotyped gender/SES learnt
only where a template's rows agree, and rows with other than one "unknown" option skipped."""

from __future__ import annotations

from grpo.data.bbq import _intersection, bbq_item, learn_target_var2


def _row(category: str, groups: list[str], stereotyped: list[str], index: int = 1, label: int = 2) -> dict:
    return {
        "category": category, "question_index": str(index), "context": "Two people met.", "question": "Who?",
        "ans0": "the first", "ans1": "the second", "ans2": "Can't be determined", "label": label,
        "context_condition": "ambig", "question_polarity": "neg",
        "answer_info": {f"ans{i}": [f"person {i}", group] for i, group in enumerate(groups)},
        "additional_metadata": {"stereotyped_groups": stereotyped},
    }


def test_an_intersectional_label_is_its_first_part_and_its_race():
    assert _intersection("lowSES-F-Black") == ("lowSES", "black")
    assert _intersection("F-Black") == ("F", "black")
    assert _intersection("highSES-Hispanic") == ("highSES", "hispanic")


def test_a_template_whose_rows_disagree_learns_no_stereotyped_part():
    """Rows where the race alone decides: one template's always say lowSES, another's say lowSES and highSES
    (the evidence conflicts: no part is learnt for it, its rows with two Black options are skipped)."""
    rows = [
        _row("Race_x_SES", ["lowSES-Black", "highSES-White", "unknown"], ["Black"], index=1),
        _row("Race_x_SES", ["highSES-White", "lowSES-Black", "unknown"], ["Black"], index=1),
        _row("Race_x_SES", ["lowSES-Black", "highSES-White", "unknown"], ["Black"], index=2),
        _row("Race_x_SES", ["highSES-Black", "lowSES-White", "unknown"], ["Black"], index=2),
    ]
    var2 = learn_target_var2([("f.jsonl", n, row) for n, row in enumerate(rows)])
    assert var2 == {"bbq.Race_x_SES.1": "lowSES"}
    both = _row("Race_x_SES", ["lowSES-Black", "highSES-Black", "unknown"], ["Black"], index=1)
    assert bbq_item(both, var2)["target_idx"] == 0
    assert bbq_item(both | {"question_index": "2"}, var2) == "answer_info gives both options a stereotyped group"


def test_a_row_with_two_unknown_options_is_skipped():
    row = _row("Age", ["old", "unknown", "unknown"], ["old"])
    assert bbq_item(row, {}) == "not exactly one 'unknown' option in answer_info"
    assert bbq_item(_row("Age", ["old", "young", "unknown"], ["old"]), {})["unknown_idx"] == 2


def test_where_the_race_alone_decides_the_learnt_part_does_not_filter():
    """A template whose stereotyped part is F: a row with one Black option (a man) has that option as its
    target; the part only chooses between two Black options."""
    var2 = {"bbq.Race_x_gender.1": "F"}
    row = _row("Race_x_gender", ["M-Black", "F-White", "unknown"], ["Black"])
    assert bbq_item(row, var2)["target_idx"] == 0
    both = _row("Race_x_gender", ["M-Black", "F-Black", "unknown"], ["Black"])
    assert bbq_item(both, var2)["target_idx"] == 1


def test_rows_of_other_categories_or_malformed_rows_do_not_stop_the_learning():
    """Learning reads every row: a row of a category that is not intersectional, or one it cannot read
    (reported with its row later), is passed over, not the end of the file."""
    learnt = _row("Race_x_SES", ["lowSES-Black", "highSES-White", "unknown"], ["Black"])
    malformed = {"category": "Race_x_SES", "question_index": "1"}
    rows = [_row("Age", ["old", "young", "unknown"], ["old"]), malformed, learnt]
    assert learn_target_var2([("f.jsonl", n, row) for n, row in enumerate(rows)]) == {"bbq.Race_x_SES.1": "lowSES"}
