"""grpo/train/copying.py and benchmarks/copying.py: the texts are what they say (the loss on the second
copy only), and the probe sees a model that copies (so a variable-length loss that stays near
ln(vocabulary) is the model's)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.copying import main
from benchmarks.embedded import fresh_embedded
from grpo.config import load_config
from grpo.model.chat import special_ids
from grpo.train.copying import copy_accuracy, copy_texts, copy_vocab
from tests.conftest import ROOT


@pytest.mark.parametrize(("length", "sizes"), [("fixed", {30}), ("variable", set(range(10, 61)))])
def test_copy_texts_repeat_a_sequence_and_mask_the_first_copy(length, sizes):
    texts = copy_texts(200, list(range(10, 90)), 1, length, seed=3)
    seen = set()
    for ids, mask in texts:
        size = (len(ids) - 1) // 2
        seen.add(size)
        assert ids[0] == 1 and len(ids) == 2 * size + 1 and ids[1 : size + 1] == ids[size + 1 :]
        assert mask == [False] * (size + 1) + [True] * size
        assert all(10 <= token < 90 for token in ids[1:])
    assert seen <= sizes and (len(seen) > 20 if length == "variable" else seen == sizes)


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "results.json"
    assert main(["--params", str(ROOT / "params.yaml"), *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_short_run_reports_every_step_it_took(tmp_path):
    results = _run(tmp_path, "--length", "variable", "--steps", "4")
    assert results["steps"] == 4 and list(results["loss_along_the_way"]) == ["1", "2", "3", "4"]
    assert results["fresh_texts"]["loss"] > 0.8 * math.log(600)  # 4 steps copy nothing


@pytest.mark.slow
def test_probe_sees_a_model_that_copies_at_a_fixed_distance(tmp_path):
    """At a fixed length the default model learns to copy within 300 steps (~25 s); a probe whose loss
    did not reach the second copy, or whose second copy were not a copy, would stay near ln(600)."""
    results = _run(tmp_path, "--length", "fixed", "--steps", "300")
    assert results["fresh_texts"]["loss"] < 1.0 and results["fresh_texts"]["token_accuracy"] > 0.8


def test_model_option_measures_the_saved_model_without_training_it(tmp_path):
    """``--model PATH --steps 0`` scores the saved weights themselves: the same loss as scoring them
    directly, and not the loss of the fresh model the probe would otherwise build."""
    cfg = load_config(ROOT / "params.yaml", ["seed=7"])
    model, tokenizer = fresh_embedded(cfg)  # other weights than the probe's own fresh model (seed 1234)
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    results = _run(tmp_path, "--model", str(tmp_path / "saved"), "--steps", "0")
    seed = load_config(ROOT / "params.yaml").seed + 1  # the probe's fresh texts
    fresh = copy_texts(64, copy_vocab(tokenizer), tokenizer.bos_token_id, "variable", seed)
    assert results["steps"] == 0 and results["model"] == str(tmp_path / "saved")
    assert results["fresh_texts"] == copy_accuracy(model, fresh, tokenizer.pad_token_id)
    assert results["fresh_texts"] != _run(tmp_path, "--steps", "0")["fresh_texts"]


def test_copy_vocab_leaves_out_every_special_token(any_tokenizer):
    """Added special tokens count too (Phi-3's ``<|end|>`` is none of ``all_special_ids``): a copy text
    holding an end-of-turn token would teach copying across a turn's end."""
    vocab = set(copy_vocab(any_tokenizer))
    special = special_ids(any_tokenizer)
    assert not vocab & special
    assert vocab | special >= set(range(len(any_tokenizer)))
