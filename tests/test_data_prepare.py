"""grpo/data/prepare.py: deterministic files, sizes and mix from params, atomic writes, valid output."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.config import DataChecksConfig, config_from_dict
from grpo.data import prepare
from grpo.data.errors import DataSourceError
from grpo.data.loaders import load_bbq, load_halueval
from grpo.data.validate import validate_files

FIXTURES = Path(__file__).parent / "fixtures"


def make_cfg(root: Path, seed: int = 1234, **data):
    return config_from_dict({"seed": seed, "paths": {"data_dir": str(root / "data"),
                                                     "reports_dir": str(root / "reports")}, "data": data})


def digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / "data").glob("*.jsonl"))}


def rows(root: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (root / "data" / f"{split}.jsonl").read_text().splitlines()]


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        prepare.run(make_cfg(tmp_path / name, seed=seed, n_train=60, n_eval=30))
    a, b, c = (digests(tmp_path / name) for name in "abc")
    assert set(a) == {"train.jsonl", "eval.jsonl"}
    assert a == b
    assert a["train.jsonl"] != c["train.jsonl"] and a["eval.jsonl"] != c["eval.jsonl"]


def test_generated_data_with_default_params_passes_the_suite(tmp_path):
    cfg = make_cfg(tmp_path)
    prepare.run(cfg)
    report = validate_files({s: tmp_path / "data" / f"{s}.jsonl" for s in ("train", "eval")}, cfg)
    assert report.success, [(r.rule, r.examples[:1], r.observed) for r in report.failures]
    assert report.n_rows == cfg.data.n_train + cfg.data.n_eval


def test_sizes_mix_and_noise_follow_params(tmp_path):
    cfg = make_cfg(tmp_path, n_train=80, n_eval=20, fairness_fraction=0.25, sft_noise=0.5)
    prepare.run(cfg)
    train, evaluation = rows(tmp_path, "train"), rows(tmp_path, "eval")
    assert len(train) == 80 and len(evaluation) == 20
    assert sum(r["task"] == "fairness" for r in train) == 20
    assert sum(r["task"] == "fairness" for r in evaluation) == 5
    ambiguous = [r for r in train if r["context_condition"] == "ambig"]
    assert sum(r["sft_label"] != r["label"] for r in ambiguous) == round(0.5 * len(ambiguous))
    unanswerable = [r for r in train if r["answerable"] is False]
    noised = [r for r in unanswerable if r["sft_answer"] != r["answer"]]
    assert len(noised) == round(0.5 * len(unanswerable))
    assert all(r["sft_answer"] == r["distractor"] for r in noised)
    assert all(r["sft_label"] is None and r["sft_answer"] is None for r in evaluation)


@pytest.mark.parametrize("answer", ["letter", "text"])
def test_fairness_records_carry_the_answer_format_and_validate(tmp_path, answer):
    cfg = make_cfg(tmp_path, n_train=40, n_eval=20, fairness_answer=answer)
    prepare.run(cfg)
    records = rows(tmp_path, "train") + rows(tmp_path, "eval")
    assert {r["answer_format"] for r in records if r["task"] == "fairness"} == {answer}
    assert {r["answer_format"] for r in records if r["task"] == "hallucination"} == {None}
    report = validate_files({s: tmp_path / "data" / f"{s}.jsonl" for s in ("train", "eval")}, cfg)
    assert report.success, [(r.rule, r.examples[:1], r.observed) for r in report.failures]


def test_train_and_eval_share_no_fairness_template_and_no_question(tmp_path):
    prepare.run(make_cfg(tmp_path, n_train=200, n_eval=80))
    train, evaluation = rows(tmp_path, "train"), rows(tmp_path, "eval")
    templates = {split: {r["template_id"] for r in data if r["task"] == "fairness"}
                 for split, data in (("train", train), ("eval", evaluation))}
    assert templates["train"] and templates["eval"] and not templates["train"] & templates["eval"]
    assert not {r["question"] for r in train if r["task"] == "hallucination"} & {
        r["question"] for r in evaluation if r["task"] == "hallucination"}


def test_a_failing_prepare_leaves_earlier_outputs_untouched(tmp_path):
    prepare.run(make_cfg(tmp_path, n_train=20, n_eval=10))
    before = digests(tmp_path)
    bad = make_cfg(tmp_path, n_train=20, n_eval=10, hallucination_source="squad2",
                   hallucination_path=str(tmp_path / "missing.json"))
    with pytest.raises(DataSourceError, match="missing.json"):
        prepare.run(bad)
    assert digests(tmp_path) == before
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["eval.jsonl", "sources.json", "train.jsonl"]


@pytest.mark.parametrize(
    ("task", "source", "path", "hint", "wrong_hint"),
    [
        # data.fairness_fraction is the fairness share: raising it asks for fewer hallucination records.
        ("fairness", "bbq", "bbq", "lower data.fairness_fraction", "raise data.fairness_fraction"),
        ("hallucination", "halueval", "halueval_qa.json", "raise data.fairness_fraction",
         "lower data.fairness_fraction"),
    ],
)
def test_a_source_too_small_for_the_sizes_says_how_to_fix(tmp_path, task, source, path, hint, wrong_hint):
    cfg = make_cfg(tmp_path, n_train=400, n_eval=100,
                   **{f"{task}_source": source, f"{task}_path": str(FIXTURES / path)})
    with pytest.raises(DataSourceError) as err:
        prepare.run(cfg)
    message = str(err.value)
    assert f"{source} gives" in message and f"{task} records" in message and "lower data.n_train" in message
    assert hint in message and wrong_hint not in message
    assert "raw items skipped:" in message  # the rows the loader dropped, by file, category and reason


def test_a_distractor_or_a_choice_over_max_answer_chars_is_a_skip_reason():
    """The suite bounds distractor and choices by data.checks.max_answer_chars, so prepare does too
    (``sft_answer`` is the answer or the distractor, so it needs no bound of its own)."""
    checks = DataChecksConfig()
    long = "x" * (checks.max_answer_chars + 1)
    fair = load_bbq(FIXTURES / "bbq", 0.25, 0).pools["train"][0]
    other = (fair["label"] + 1) % 3
    halueval = load_halueval(FIXTURES / "halueval_qa.json", 0.25, 0)
    grounded = next(i for i in halueval.pools["train"] if i["distractor"])
    assert prepare._too_long(fair, checks) is None and prepare._too_long(grounded, checks) is None
    fair_long = {**fair, "choices": [long if k == other else c for k, c in enumerate(fair["choices"])]}
    assert prepare._too_long(fair_long, checks) == "a choice longer than data.checks.max_answer_chars (200)"
    assert prepare._too_long({**grounded, "distractor": long}, checks) == (
        "distractor longer than data.checks.max_answer_chars (200)")
    exactly = "x" * checks.max_context_chars  # the suite's bound is inclusive
    assert prepare._too_long({**grounded, "context": exactly}, checks) is None
    assert prepare._too_long({**grounded, "context": exactly + "x"}, checks) == (
        f"context longer than data.checks.max_context_chars ({checks.max_context_chars})")


def test_a_halueval_hallucinated_answer_over_the_bound_is_skipped_and_the_output_validates(tmp_path):
    # Four of the fixture's hallucinated answers are longer than 60 characters, none of its right answers.
    cfg = config_from_dict({
        "paths": {"data_dir": str(tmp_path / "data"), "reports_dir": str(tmp_path / "reports")},
        "data": {"n_train": 8, "n_eval": 4, "sft_noise": 0.5, "checks": {"max_answer_chars": 60},
                 "hallucination_source": "halueval", "hallucination_path": str(FIXTURES / "halueval_qa.json")},
    })
    prepare.run(cfg)
    skipped = json.loads((tmp_path / "data" / "sources.json").read_text())["hallucination"]["skipped"]
    assert any(row["reason"] == "distractor longer than data.checks.max_answer_chars (60)" for row in skipped)
    report = validate_files({s: tmp_path / "data" / f"{s}.jsonl" for s in ("train", "eval")}, cfg)
    assert report.success, [(r.rule, r.examples[:1], r.observed) for r in report.failures]


def test_cli_prepare_then_validate(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "paths": {name: str(tmp_path / name.removesuffix("_dir")) for name in ("data_dir", "reports_dir", "metrics_dir")},
        "data": {"n_train": 40, "n_eval": 20, "checks": {"data_docs": False}},
    }))
    assert main(["prepare", "--params", str(params)]) == 0
    assert main(["validate", "--params", str(params)]) == 0
    assert json.loads((tmp_path / "metrics" / "key" / "validate" / "rows.json").read_text()) == {"value": 60}
    # A broken file makes the command fail with the rule in its message.
    train = tmp_path / "data" / "train.jsonl"
    train.write_text(train.read_text().replace('"task": "fairness"', '"task": "fair"', 1))
    assert main(["validate", "--params", str(params)]) == 1
    assert "task.in_set" in capsys.readouterr().err


def test_a_published_source_is_split_and_sampled_as_the_params_say(tmp_path, monkeypatch):
    shares = []

    def recording(path, eval_share, seed):
        shares.append(eval_share)
        return load_halueval(path, eval_share, seed)

    monkeypatch.setitem(prepare.LOADERS, "halueval", recording)
    cfg = make_cfg(tmp_path, n_train=8, n_eval=4, answerable_fraction=0.25, hallucination_source="halueval",
                   hallucination_path=str(FIXTURES / "halueval_qa.json"))
    prepare.run(cfg)
    assert shares == [4 / 12]  # eval's share of all the records asked for, not of train's
    for split, n in (("train", 4), ("eval", 2)):  # the hallucination half of each split
        answerable = [r["answerable"] for r in rows(tmp_path, split) if r["task"] == "hallucination"]
        assert len(answerable) == n and sum(answerable) == round(0.25 * n), split


def test_a_train_text_repeated_in_eval_is_dropped_from_eval():
    item = {"context": "Kelby makes ink.", "question": "What does Kelby make?", "answer": "ink", "category": "company"}
    other = {**item, "question": "Who founded Kelby?"}
    skipped = Counter()
    kept = prepare._usable({"train": [item], "eval": [dict(item, context="kelby makes ink"), other]},
                           DataChecksConfig(), skipped, Path("raw.json"))
    assert kept == {"train": [item], "eval": [other]}
    assert skipped == {("raw.json", "company", "repeated (context, question)"): 1}


def test_each_split_interleaves_the_tasks(tmp_path):
    """The splits are shuffled once the tasks are joined: SFT's batches and GRPO's prompt order see both
    tasks throughout, not one task's block then the other's."""
    cfg = make_cfg(tmp_path, n_train=32, n_eval=16)
    assert prepare.run(cfg) == 0
    for split in ("train", "eval"):
        tasks = [json.loads(line)["task"] for line in (tmp_path / "data" / f"{split}.jsonl").read_text().splitlines()]
        half = len(tasks) // 2
        assert len(set(tasks[:half])) == 2 and len(set(tasks[half:])) == 2, tasks
