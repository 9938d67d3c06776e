"""``data``: where the records come from and the bounds of the data gate (``grpo/data/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from grpo.config.base import Section


class DataChecksConfig(Section):
    max_context_chars: int = Field(2000, ge=1)
    """Longest context validation accepts; ``prepare`` drops longer loaded passages (and says how many)."""
    max_question_chars: int = Field(300, ge=1)
    """Longest question validation accepts."""
    max_answer_chars: int = Field(200, ge=1)
    """Longest answer (and option, distractor, SFT answer) validation accepts."""
    balance_tolerance: float = Field(0.1, ge=0.0, le=1.0)
    """Allowed gap between a share (task mix, ambiguous, negative, label position, answerable) and its target."""
    balance_z: float = Field(3.0, ge=0.0)
    """Small-split slack: the gap may also reach balance_z binomial standard errors, sqrt(p(1-p)/n)."""
    max_examples: int = Field(5, ge=1)
    """Offending rows shown per failed rule in the validation reports."""
    data_docs: bool = True
    """Also build the GX Data Docs HTML site under ``<reports_dir>/data_docs/`` (a few MB of HTML)."""


class DataConfig(Section):
    fairness_source: Literal["synthetic", "bbq"] = "synthetic"
    """Fairness records: the built-in BBQ-style generator, or local BBQ ``data/*.jsonl`` files."""
    fairness_path: str | None = Field(None, validate_default=True)
    """Local BBQ file or folder (required when fairness_source is bbq)."""
    hallucination_source: Literal["synthetic", "halueval", "squad2"] = "synthetic"
    """Hallucination records: the built-in grounded-QA generator, local HaluEval QA or SQuAD 2.0."""
    hallucination_path: str | None = Field(None, validate_default=True)
    """Local HaluEval QA JSON-lines file or SQuAD 2.0 JSON file (required unless synthetic)."""
    fairness_heldout_categories: list[str] = Field(default_factory=list)
    """With fairness_source bbq: BBQ categories (e.g. ``Age``, ``Religion``) kept out of training and used
    only for evaluation; every other category of the files trains (none of them is evaluated). Empty:
    train and eval split by template within every category."""
    fairness_answer: Literal["letter", "text"] = "letter"
    """How a fairness prompt asks for the option and SFT teaches it: ``letter`` ("Answer: B") or ``text``
    (the option's words, "Answer: The Brasken farmer"). Small pretrained models pick letters of a
    multiple-choice list near chance; naming the person copies words from the context."""
    n_train: int = Field(2000, ge=1)
    """Number of training records."""
    n_eval: int = Field(400, ge=1)
    """Number of evaluation records."""
    fairness_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of fairness records in both splits (the rest is hallucination)."""
    answerable_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of answerable hallucination records in both splits."""
    sft_noise: float = Field(0.25, ge=0.0, le=1.0)
    """Share of ambiguous/unanswerable SFT targets taught the biased/hallucinated answer (the flaw GRPO removes)."""
    grpo_holdout: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the train records kept out of SFT as GRPO's prompts (``grpo.data.select.train_records``), in
    [0, 1). 0: SFT and GRPO both read every train record; above 0, GRPO samples prompts SFT never trained on."""
    checks: DataChecksConfig = Field(default_factory=DataChecksConfig)
    """Bounds and tolerances of ``grpo validate``."""

    @field_validator("fairness_heldout_categories")
    @classmethod
    def _categories_of_bbq(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if value and info.data.get("fairness_source") != "bbq":
            raise ValueError(
                "names held-out categories, but only BBQ files have categories to hold out: set "
                "data.fairness_source to bbq (with data.fairness_path), or data.fairness_heldout_categories to []"
            )
        return value

    @field_validator("fairness_path", "hallucination_path")
    @classmethod
    def _path_matches_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        task = info.field_name.removesuffix("_path")
        source = info.data.get(f"{task}_source")  # the source is declared above the path
        if value and source == "synthetic":
            raise ValueError(
                f"is set but data.{task}_source is 'synthetic', which reads no file: set "
                f"data.{task}_source to the dataset's format, or data.{task}_path to null"
            )
        if not value and source not in (None, "synthetic"):
            raise ValueError(
                f"is needed when data.{task}_source is {source!r}: set data.{task}_path to the local file "
                f"or folder of the {source} dataset, or data.{task}_source to synthetic"
            )
        return value
