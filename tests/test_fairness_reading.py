"""benchmarks/fairness_reading.py: the probe trains on what it says, scores every option, and can see
a model that reads (so its chance-level figures on both polarities are the model's, not the probe's)."""

from __future__ import annotations

import json

import pytest

from benchmarks.fairness_reading import answer_target, disambiguated, main
from grpo.data.prompts import sft_target
from tests.conftest import ROOT


def test_disambiguated_keeps_the_asked_polarity_and_condition():
    both = disambiguated(40, "train", 5, "both")
    neg = disambiguated(40, "train", 5, "neg")
    assert len(both) == len(neg) == 40
    assert all(r["context_condition"] == "disambig" for r in both + neg)
    assert {r["question_polarity"] for r in both} == {"neg", "nonneg"}
    assert {r["question_polarity"] for r in neg} == {"neg"}


def test_answer_target_is_the_sft_letter_or_the_option_text():
    (record,) = disambiguated(1, "eval", 3, "both")
    for option, letter in enumerate("ABC"):
        assert answer_target(record, option, "letter") == sft_target({**record, "sft_label": option}) == f"Answer: {letter}"
        assert answer_target(record, option, "text") == f"Answer: {record['choices'][option]}"


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "results.json"
    assert main(["--params", str(ROOT / "params.yaml"), *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_counts(result: dict, items: int) -> None:
    picked = result["picked"]
    assert result["items"] == items
    assert picked.get("right person", 0) + picked.get("other person", 0) + picked.get("unknown", 0) == items
    assert sum(count for key, count in picked.items() if key.startswith("option ")) == items
    assert result["accuracy"] == round(picked.get("right person", 0) / items, 3)


@pytest.mark.parametrize(("extra", "steps"), [((), 2), (("--curriculum",), 4)])
def test_results_count_every_probed_item(tmp_path, extra, steps):
    """32 records at pretrain.batch_size 16: 2 steps, and 2 more for the negative-only phase first."""
    results = _run(tmp_path, "--records", "32", "--epochs", "1", "--probe", "12", *extra)
    assert results["records"] == 32 and results["steps"] == steps and results["curriculum"] == bool(extra)
    for split in ("training_scenes", "held_out_scenes"):
        _check_counts(results[split], 12)


@pytest.mark.slow
def test_probe_sees_a_model_that_reads(tmp_path):
    """Negative questions only, the option's text as the answer: the one setting the default model
    learns (the first person of the disambiguating sentence). A broken scorer would stay at chance."""
    results = _run(tmp_path, "--polarity", "neg", "--answer", "text", "--records", "2000", "--epochs", "3",
                   "--probe", "60")
    _check_counts(results["training_scenes"], 60)
    assert results["training_scenes"]["accuracy"] >= 0.8  # 375 steps; 1.0 after 564 (README)
