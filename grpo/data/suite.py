"""The Great Expectations suite over the processed data: one named rule per expectation.

Every expectation carries ``meta={"rule": name}``; the reports and the error message use that name.
Rules (the tests break the data once per rule family and expect the name back):

- schema: ``required.<field>``, ``schema.unknown_fields``, ``schema.types``, ``<field>.in_set``,
  ``id.format``, ``id.content_hash``, ``split.matches_file``, ``count.<split>``
- text: ``text.utf8``, ``text.control_chars``, ``text.template_slots``, ``text.blank``, ``length.<field>``
- fairness: ``fairness.required``, ``fairness.three_choices``, ``fairness.distinct_choices``,
  ``fairness.label_range``, ``fairness.unknown_idx_range``, ``fairness.target_idx_range``,
  ``fairness.one_unknown_option``, ``fairness.unknown_idx_matches``, ``fairness.ambig_label_unknown``,
  ``fairness.disambig_label_known``, ``fairness.answer_is_choice``
- hallucination: ``hallucination.required``, ``hallucination.no_choices``,
  ``hallucination.answer_in_context``, ``hallucination.unanswerable_abstains``,
  ``hallucination.distractor_not_in_context``, ``hallucination.distractor_not_gold``
- SFT targets: ``sft.fields``, ``sft.consistent``, ``sft.noise_share.<task>``
- duplicates and leakage: ``unique.id``, ``unique.text``, ``leakage.id``, ``leakage.text``
- balance per split: ``balance.task_mix.<split>``, ``balance.ambig.<split>``,
  ``balance.polarity.<split>``, ``balance.label_position.<split>``, ``balance.answerable.<split>``
"""

from __future__ import annotations

import math

import great_expectations.expectations as gxe
import pandas as pd

from grpo.config import Config, DataChecksConfig
from grpo.data.schema import SOURCES, SPLITS, TASKS

REQUIRED = ("id", "task", "source", "split", "context", "question", "answer", "category", "template_id")
"""Fields no record may leave null."""

# C0 controls and DEL, except tab and newline (which a passage may legitimately hold).
CONTROL_CHARS = r"[\x00-\x08\x0b-\x1f\x7f]"
# {name} / {{NAME1}} format slots, [[X]] BBQ slots, bare NAME1/WORD2/GROUP1 placeholders.
TEMPLATE_SLOTS = r"\{\{?\s*[A-Za-z_][A-Za-z0-9_]*\s*\}\}?|\[\[[^\]]*\]\]|\b(?:NAME|WORD|GROUP)\d\b"

MUST_BE_TRUE = {
    "text.utf8": "utf8_ok",
    "id.content_hash": "id_matches_content",
    "split.matches_file": "split_matches_file",
    "fairness.distinct_choices": "fair_choices_distinct",
    "fairness.label_range": "fair_label_in_range",
    "fairness.unknown_idx_range": "fair_unknown_idx_in_range",
    "fairness.target_idx_range": "fair_target_idx_in_range",
    "fairness.unknown_idx_matches": "fair_unknown_idx_matches",
    "fairness.ambig_label_unknown": "fair_ambig_label_unknown",
    "fairness.disambig_label_known": "fair_disambig_label_known",
    "fairness.answer_is_choice": "fair_answer_is_choice",
    "hallucination.no_choices": "hall_no_choices",
    "hallucination.answer_in_context": "hall_answer_in_context",
    "hallucination.unanswerable_abstains": "hall_abstains",
    "hallucination.distractor_not_in_context": "hall_distractor_not_in_context",
    "hallucination.distractor_not_gold": "hall_distractor_not_gold",
    "sft.consistent": "sft_consistent",
}
"""Rule -> derived boolean column every applicable row must hold True in."""

MUST_BE_EMPTY = {
    "schema.unknown_fields": "schema_unknown_fields",
    "schema.types": "schema_types",
    "fairness.required": "fair_missing",
    "hallucination.required": "hall_missing",
    "sft.fields": "sft_fields",
}
"""Rule -> derived column listing a row's problems ("" when it has none)."""


def _meta(rule: str) -> dict[str, str]:
    return {"rule": rule}


def share_bounds(target: float, n: int, checks: DataChecksConfig) -> tuple[float, float]:
    """Accepted range of a share over ``n`` rows: the tolerance, or balance_z standard errors if wider."""
    slack = max(checks.balance_tolerance, checks.balance_z * math.sqrt(target * (1 - target) / n))
    return max(0.0, target - slack), min(1.0, target + slack)


def _count(frame: pd.DataFrame, column: str) -> int:
    return int(frame[column].notna().sum()) if column in frame else 0


def _schema(cfg: Config) -> list[gxe.Expectation]:
    out: list[gxe.Expectation] = [
        gxe.ExpectColumnValuesToNotBeNull(column=field, meta=_meta(f"required.{field}")) for field in REQUIRED
    ]
    for field, allowed in (
        ("task", TASKS),
        ("split", SPLITS),
        ("source", SOURCES),
        ("context_condition", ("ambig", "disambig")),
        ("question_polarity", ("neg", "nonneg")),
    ):
        out.append(
            gxe.ExpectColumnValuesToBeInSet(
                column=field, value_set=list(allowed), meta=_meta(f"{field}.in_set")
            )
        )
    out.append(
        gxe.ExpectColumnValuesToMatchRegex(column="id", regex=r"^[0-9a-f]{16}$", meta=_meta("id.format"))
    )
    for split, n in (("train", cfg.data.n_train), ("eval", cfg.data.n_eval)):
        out.append(
            gxe.ExpectColumnSumToBeBetween(
                column=f"is_{split}", min_value=n, max_value=n, meta=_meta(f"count.{split}")
            )
        )
    return out


def _text(checks: DataChecksConfig) -> list[gxe.Expectation]:
    out: list[gxe.Expectation] = []
    # One scan of every text field of a row (``all_text``): GX's cost is per expectation, not per row.
    out.append(
        gxe.ExpectColumnValuesToNotMatchRegex(
            column="all_text", regex=CONTROL_CHARS, meta=_meta("text.control_chars")
        )
    )
    out.append(
        gxe.ExpectColumnValuesToNotMatchRegex(
            column="all_text", regex=TEMPLATE_SLOTS, meta=_meta("text.template_slots")
        )
    )
    for column in ("context", "question", "answer"):
        out.append(gxe.ExpectColumnValuesToMatchRegex(column=column, regex=r"\S", meta=_meta("text.blank")))
    limits = {
        "context": checks.max_context_chars,
        "question": checks.max_question_chars,
        "answer": checks.max_answer_chars,
        "distractor": checks.max_answer_chars,
        "sft_answer": checks.max_answer_chars,
        "category": 100,
        "template_id": 200,
    }
    for column, limit in limits.items():
        out.append(
            gxe.ExpectColumnValueLengthsToBeBetween(
                column=column, min_value=1, max_value=limit, meta=_meta(f"length.{column}")
            )
        )
    out.append(
        gxe.ExpectColumnValuesToBeBetween(
            column="choice_len_max",
            min_value=1,
            max_value=checks.max_answer_chars,
            meta=_meta("length.choices"),
        )
    )
    return out


def _records(frame: pd.DataFrame) -> list[gxe.Expectation]:
    out: list[gxe.Expectation] = [
        gxe.ExpectColumnValuesToBeInSet(column=column, value_set=[True], meta=_meta(rule))
        for rule, column in MUST_BE_TRUE.items()
        if column in frame
    ]
    out += [
        gxe.ExpectColumnValuesToBeInSet(column=column, value_set=[""], meta=_meta(rule))
        for rule, column in MUST_BE_EMPTY.items()
        if column in frame
    ]
    if "fair_n_choices" in frame:
        out.append(
            gxe.ExpectColumnValuesToBeInSet(
                column="fair_n_choices", value_set=[3], meta=_meta("fairness.three_choices")
            )
        )
        out.append(
            gxe.ExpectColumnValuesToBeInSet(
                column="fair_unknown_options", value_set=[1], meta=_meta("fairness.one_unknown_option")
            )
        )
    out += [
        gxe.ExpectCompoundColumnsToBeUnique(column_list=["split", "id"], meta=_meta("unique.id")),
        gxe.ExpectCompoundColumnsToBeUnique(column_list=["split", "text_hash"], meta=_meta("unique.text")),
        gxe.ExpectColumnValuesToBeInSet(column="id_leak", value_set=[False], meta=_meta("leakage.id")),
        gxe.ExpectColumnValuesToBeInSet(column="text_leak", value_set=[False], meta=_meta("leakage.text")),
    ]
    return out


def _mean_rule(
    frame: pd.DataFrame, rule: str, column: str, bounds: tuple[float, float]
) -> list[gxe.Expectation]:
    if _count(frame, column) == 0:
        return []
    return [
        gxe.ExpectColumnMeanToBeBetween(
            column=column, min_value=bounds[0], max_value=bounds[1], meta=_meta(rule)
        )
    ]


def _balance(frame: pd.DataFrame, cfg: Config) -> list[gxe.Expectation]:
    checks, out = cfg.data.checks, []
    targets = [
        ("task_mix", "is_fairness", cfg.data.fairness_fraction),
        ("ambig", "ambig", 0.5),
        ("polarity", "neg", 0.5),
        ("answerable", "answerable", cfg.data.answerable_fraction),
    ]
    targets += [("label_position", f"label{k}", 1 / 3) for k in range(3)]
    for split in SPLITS:
        for name, prefix, target in targets:
            column = f"{prefix}_{split}"
            if n := _count(frame, column):
                out += _mean_rule(frame, f"balance.{name}.{split}", column, share_bounds(target, n, checks))
    for task, column in (("fairness", "sft_noised_fair"), ("hallucination", "sft_noised_hall")):
        if n := _count(frame, column):
            # The noise is an exact count (round(fraction * n)), so only that count is accepted.
            k = round(cfg.data.sft_noise * n)
            out += _mean_rule(frame, f"sft.noise_share.{task}", column, ((k - 0.5) / n, (k + 0.5) / n))
    return out


def build_expectations(frame: pd.DataFrame, cfg: Config) -> list[gxe.Expectation]:
    """Every expectation of the suite for this frame (balance bounds depend on its row counts)."""
    return _schema(cfg) + _text(cfg.data.checks) + _records(frame) + _balance(frame, cfg)
