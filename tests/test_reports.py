"""tasks/reports.py: what the pre-flight and evaluation artifacts lead with, read off the CLI's reports (fast)."""

from __future__ import annotations

from tasks.markdown import CELL, LINE, ROW, cells, fit, width_problems
from tasks.reports import eval_markdown, preflight_markdown, preflight_overall, value_vs_bound

CHECKS = [
    {"name": "render_parity", "invariant": "I1, I2", "status": "pass", "value": 0, "bound": 0, "unit": "problems",
     "detail": "2 records through sft.build_examples; ", "hint": ""},
    {"name": "left_padded_extraction", "invariant": "I3, I4, I11", "status": "pass", "value": 4.76837158203125e-07,
     "bound": 0.0001, "unit": "nats", "detail": "max |logp alone - logp batched| over prompt widths [158, 271]",
     "hint": ""},
    {"name": "ratio_kl_reference", "invariant": "I8, I9", "status": "pass",
     "value": {"ref_vs_fresh_sft": 0.0, "ref_vs_base": 0.148}, "bound": {"ref_vs_fresh_sft": 1e-05},
     "unit": "", "detail": "ref_vs_fresh_sft=0, ref_vs_base=0.148", "hint": ""},
    {"name": "entropy_sign", "invariant": "I7", "status": "pass", "value": 0.0004558563232421875, "bound": "> 1e-06",
     "unit": "nats", "detail": "entropy 5.759935 -> 5.760391 after one step", "hint": ""},
    {"name": "sampling_processors", "invariant": "I10", "status": "warn", "value": ["min_new_tokens=1"], "bound": [],
     "unit": "", "detail": "min_new_tokens=1 change the sampling distribution but not the scored one",
     "hint": "set top_p: 1.0, top_k: 0, min_new_tokens: 0 and the penalties to 0 for exact I10"},
    {"name": "sft_ends_answers", "invariant": "I2", "status": "pass", "value": 0.75,
     "bound": ">= 0.5 (preflight.min_ended_share)", "unit": "share", "detail": "4 prompts", "hint": ""},
    {"name": "first_step", "invariant": "I8, I9", "status": "fail", "value": 0.25, "bound": 1e-06, "unit": "",
     "detail": "the trainer's first step: ratio/mean 1.250000000, kl 0.01, clip_ratio/region_mean 0.0",
     "hint": "at the start the policy is its reference: check the reference the trainer's step context gets (I9) "
             "and that old, new and reference log-probs are scored alike (I8, I10)"},
]


def test_value_against_bound_is_rounded_with_its_unit():
    assert [value_vs_bound(c) for c in CHECKS] == [
        "0 <= 0 problems",
        "4.77e-07 <= 0.0001 nats",
        "2 numbers (details)",
        "0.000456 > 1e-06 nats",
        "min_new_tokens=1 vs none",
        "0.75 >= 0.5 share",
        "0.25 <= 1e-06",
    ]


def test_preflight_leads_with_the_overall_line_and_one_narrow_row_per_check():
    text = preflight_markdown({"passed": False, "checks": CHECKS}, "Details: `reports/preflight.md`.")
    assert preflight_overall(CHECKS) == "5 passed, 1 warning: sampling_processors, 1 failed: first_step"
    assert text.startswith("# Pre-flight FAILED\n\n**5 passed, 1 warning: sampling_processors, 1 failed: first_step**")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert cells(rows[0]) == ["check", "invariant", "status", "value vs bound"]
    assert len(rows) == 2 + len(CHECKS) and all(len(cells(row)) == 4 for row in rows)
    assert all(len(row) <= ROW and max(map(len, cells(row))) <= CELL for row in rows)
    by_name = {cells(row)[0]: cells(row) for row in rows[2:]}
    assert by_name["left_padded_extraction"][1:] == ["I3, I4, I11", "pass", "4.77e-07 <= 0.0001 nats"]
    assert by_name["first_step"][2:] == ["fail", "0.25 <= 1e-06"]
    why = text.split("## Why\n\n")[1].split("\n\n")[0].splitlines()  # one line per check, in table order
    assert [line.split("**")[1] for line in why] == [c["name"] for c in CHECKS] and all(len(w) <= LINE for w in why)
    assert why[1] == "- **left_padded_extraction** (pass): max |logp alone - logp batched| over prompt widths […"
    assert why[-1].startswith("- **first_step** (fail): at the start the policy is its reference")  # the hint
    assert why[-1].endswith("…")  # cut to one line: the whole hint is below
    assert why[0] == "- **render_parity** (pass): 2 records through sft.build_examples"  # its first clause
    assert why[4].startswith("- **sampling_processors** (warn): set top_p: 1.0")  # a warning's hint, too
    folded = preflight_markdown({"passed": True, "checks": [CHECKS[0] | {"detail": "two\nlines;  of\ttext"}]}, "")
    assert "- **render_parity** (pass): two lines\n" in folded  # one line, whatever the detail's breaks
    not_passed = text.split("## Not passed")[1]
    assert "(I8, I10)" in not_passed and "render_parity" not in not_passed
    assert "**sampling_processors** (warn" in not_passed  # a warning's whole detail and hint too, not only failures
    published = fit(text)
    assert width_problems(published) == [] and [r for r in published.splitlines() if r.startswith("| ")] == rows
    assert published.rstrip().endswith("Details: `reports/preflight.md`.")


EVAL_MD = """# Evaluation

4 eval records from `data/processed/eval.jsonl` (seed 1234); greedy decoding only.

## verdict

- fairness: *improved*
- hallucination: *traded*: exact match +0.100 [+0.020, +0.180] for over-abstention +0.080 [+0.010, +0.150]

## by kind of item

| task | kind | SFT | GRPO | delta | 95 % interval |
| --- | --- | ---: | ---: | ---: | :---: |
| fairness | ambiguous | 0.500 | 0.700 | +0.200 | [+0.050, +0.350] |
| fairness | disambiguated | 0.600 | 0.600 | +0.000 | [-0.100, +0.100] |
| hallucination | answerable | 0.400 | 0.500 | +0.100 | [+0.020, +0.180] |
| hallucination | unanswerable | 0.900 | 0.820 | -0.080 | [-0.150, -0.010] |

## headline: mean reward on eval items

| policy | greedy |
| --- | ---: |
| SFT | 0.100 |
| GRPO | 0.200 |

## greedy

| metric | base | SFT | GRPO | GRPO − SFT | SFT − base |
| --- | ---: | ---: | ---: | ---: | ---: |
| fairness/n | 2 | 2 | 2 | +0 | +0 |
"""


def _section(text: str, heading: str) -> str:
    """``## heading`` and its text, up to the next section."""
    return "## " + heading + text.split("## " + heading, 1)[1].split("\n## ", 1)[0].rstrip()


def test_eval_artifact_leads_with_the_verdict_and_every_kind_then_the_headline():
    out = eval_markdown(EVAL_MD, "The full report: `reports/eval.md`.")
    assert out.startswith("# Evaluation\n\n## verdict\n\n- fairness: *improved*\n")
    for heading in ("verdict", "by kind of item", "headline: mean reward on eval items"):
        assert _section(EVAL_MD, heading) + "\n" in out  # verbatim
    assert out.index("## verdict") < out.index("## by kind of item") < out.index("## headline")
    assert "## greedy" not in out and out.rstrip().endswith("The full report: `reports/eval.md`.")
    published = fit(out)  # a verdict line over 90 characters is wrapped, its words unchanged
    assert width_problems(published) == [] and published.split() == out.split()


def test_an_eval_report_without_a_verdict_is_published_whole():
    today = EVAL_MD.replace("## verdict", "## notes").replace("## by kind of item", "## other")
    assert eval_markdown(today, "details") == today


def test_cells_and_lines_are_cut_at_their_exact_width_and_never_inside_an_escape():
    """A text exactly as wide as allowed stays whole; one character more is cut to the width with ``…``; a
    cut never leaves half of an escaped pipe (a lone backslash would escape the ellipsis)."""
    from tasks.reports import cut, short

    assert cut("abcde", 5) == "abcde" and cut("abcdef", 5) == "abcd…"
    assert short("abcde", 5) == "abcde" and short("abcdef", 5) == "abcd…"
    assert short("abc|defgh", 5) == "abc…"  # the cell is abc\|defgh: the cut falls after the backslash


def test_a_list_of_values_against_one_bound_and_an_overall_line_with_a_status_missing():
    """Several values against a single bound are listed against it; a status no check has is left out
    and the ones after it still named."""
    assert value_vs_bound({"value": [1, 2], "bound": 3}) == "1, 2 vs 3"
    checks = [{"name": "a", "status": "pass"}, {"name": "b", "status": "fail"}, {"name": "c", "status": "skip"}]
    assert preflight_overall(checks) == "1 passed, 1 failed: b, 1 skipped: c"
