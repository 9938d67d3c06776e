"""grpo/data/validate.py: the GX gate passes clean data and names the rule of every kind of defect.

The broken corpus is a table: defect -> a mutation of a clean prepared dataset -> the rule that must
reject it. Every case also checks that validation left the data and an earlier model file untouched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from grpo.config import Config, config_from_dict
from grpo.data import prepare, validate
from grpo.data.errors import DataValidationError
from grpo.data.schema import ABSTENTION

Rows = dict[str, list[dict]]


def make_cfg(root: Path, data_docs: bool = False) -> Config:
    # Data Docs cost half a second a run: only the test of the clean data builds them.
    return config_from_dict({
        "paths": {"data_dir": str(root / "data"), "reports_dir": str(root / "reports"),
                  "models_dir": str(root / "models")},
        "data": {"n_train": 48, "n_eval": 24, "checks": {"data_docs": data_docs}},
    })


@pytest.fixture(scope="module")
def clean_rows(tmp_path_factory) -> Rows:
    """A small clean dataset (prepared once per module), as parsed JSON rows per split."""
    root = tmp_path_factory.mktemp("clean")
    prepare.run(make_cfg(root))
    return {split: [json.loads(line) for line in (root / "data" / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "eval")}


def first(rows: list[dict], **where) -> dict:
    return next(row for row in rows if all(row.get(k) == v for k, v in where.items()))


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and "reports" not in p.parts and not is_lock(p)}


def is_lock(path: Path) -> bool:
    """A stage's folder lock (``.<folder>.lock``): the mark of a writer, never an output."""
    return path.name.startswith(".") and path.suffix == ".lock"


# --------------------------------------------------------------------------- mutations


def missing_field(r: Rows) -> None:
    del r["train"][0]["question"]


def null_value(r: Rows) -> None:
    r["train"][0]["context"] = None


def bad_task(r: Rows) -> None:
    r["train"][0]["task"] = "sentiment"


def label_out_of_range(r: Rows) -> None:
    first(r["train"], task="fairness")["label"] = 5


def two_unknown_options(r: Rows) -> None:
    row = first(r["train"], task="fairness", context_condition="ambig")
    other = ({0, 1, 2} - {row["unknown_idx"], row["target_idx"]}).pop()
    row["choices"][other] = "Cannot answer"


def ambiguous_with_person_label(r: Rows) -> None:
    row = first(r["train"], task="fairness", context_condition="ambig")
    row["label"], row["sft_label"] = row["target_idx"], row["target_idx"]
    row["answer"] = row["choices"][row["label"]]


def disambiguated_with_unknown_label(r: Rows) -> None:
    row = first(r["eval"], task="fairness", context_condition="disambig")
    row["label"] = row["unknown_idx"]
    row["answer"] = row["choices"][row["label"]]


def answer_not_in_context(r: Rows) -> None:
    row = first(r["train"], task="hallucination", answerable=True)
    row["answer"] = row["sft_answer"] = "Zanzibar"


def distractor_in_context(r: Rows) -> None:
    row = first(r["train"], task="hallucination", answerable=False)
    row["context"] += f" Some say {row['distractor']}."


def unanswerable_not_abstaining(r: Rows) -> None:
    row = first(r["eval"], task="hallucination", answerable=False)
    row["answer"] = "Port Ilva"
    assert row["answer"] != ABSTENTION


def duplicate_id(r: Rows) -> None:
    r["train"][1]["id"] = r["train"][0]["id"]


def malformed_id(r: Rows) -> None:
    r["train"][0]["id"] += "0"  # 17 hex digits: not an id the project makes


def duplicate_text(r: Rows) -> None:
    a, b = r["train"][0], r["train"][1]
    b["context"], b["question"] = a["context"].upper(), a["question"] + "!"


def leakage_by_id(r: Rows) -> None:
    leaked = dict(first(r["eval"], task="hallucination", answerable=True), split="train")
    leaked["sft_answer"] = leaked["answer"]
    r["train"][0] = leaked


def leakage_by_text(r: Rows) -> None:
    source = r["eval"][0]
    r["train"][0]["context"], r["train"][0]["question"] = source["context"].lower(), source["question"]


def empty_string(r: Rows) -> None:
    r["eval"][0]["question"] = ""


def control_characters(r: Rows) -> None:
    r["train"][2]["context"] += " Ring\x07 the bell."


def template_slot(r: Rows) -> None:
    r["train"][2]["question"] = "Who met {name} at the station?"


def over_long_context(r: Rows) -> None:
    r["train"][3]["context"] += " The weather was calm." * 120


def extreme_imbalance(r: Rows) -> None:
    r["train"] = [row for row in r["train"] if row.get("context_condition") != "disambig"]


def wrong_type(r: Rows) -> None:
    first(r["train"], task="fairness")["unknown_idx"] = "1"


def unknown_field(r: Rows) -> None:
    r["train"][0]["lable"] = 1


def record_in_wrong_file(r: Rows) -> None:
    r["train"][0]["split"] = "eval"


def lone_surrogate(r: Rows) -> None:
    r["eval"][1]["question"] = "Who\ud800 came?"


def inconsistent_sft_target(r: Rows) -> None:
    row = first(r["train"], task="fairness", context_condition="disambig")
    row["sft_label"] = row["unknown_idx"]


def truncated_split(r: Rows) -> None:
    r["train"].pop()  # one record fewer than data.n_train


def blank_question(r: Rows) -> None:
    r["eval"][0]["question"] = "   "


def unknown_index_at_a_person(r: Rows) -> None:
    row = first(r["train"], task="fairness", context_condition="disambig")
    row["unknown_idx"] = ({0, 1, 2} - {row["unknown_idx"], row["target_idx"]}).pop()


def target_index_at_the_unknown(r: Rows) -> None:
    row = first(r["train"], task="fairness", context_condition="disambig")
    row["target_idx"] = row["unknown_idx"]


def bbq_slot(r: Rows) -> None:
    first(r["train"], task="fairness")["context"] += " The [[occupation]] left early."


def sft_noise_one_short(r: Rows) -> None:
    row = next(row for row in r["train"] if row["task"] == "fairness" and row["sft_label"] != row["label"])
    row["sft_label"] = row["label"]


BROKEN: list[tuple[str, Callable[[Rows], None], str]] = [
    # defect, mutation, rule that must name it
    ("missing field", missing_field, "required.question"),
    ("null", null_value, "required.context"),
    ("bad task", bad_task, "task.in_set"),
    ("label out of range", label_out_of_range, "fairness.label_range"),
    ("two unknown options", two_unknown_options, "fairness.one_unknown_option"),
    ("ambiguous with a person label", ambiguous_with_person_label, "fairness.ambig_label_unknown"),
    ("disambiguated with unknown label", disambiguated_with_unknown_label, "fairness.disambig_label_known"),
    ("answer not in context", answer_not_in_context, "hallucination.answer_in_context"),
    ("distractor in context", distractor_in_context, "hallucination.distractor_not_in_context"),
    ("unanswerable without abstention", unanswerable_not_abstaining, "hallucination.unanswerable_abstains"),
    ("duplicate id", duplicate_id, "unique.id"),
    ("malformed id", malformed_id, "id.format"),
    ("duplicate text", duplicate_text, "unique.text"),
    ("train/eval leakage by id", leakage_by_id, "leakage.id"),
    ("train/eval leakage by text", leakage_by_text, "leakage.text"),
    ("empty string", empty_string, "length.question"),
    ("control characters", control_characters, "text.control_chars"),
    ("leftover template slot", template_slot, "text.template_slots"),
    ("over-long context", over_long_context, "length.context"),
    ("extreme imbalance", extreme_imbalance, "balance.ambig.train"),
    ("wrong type", wrong_type, "schema.types"),
    ("unknown field", unknown_field, "schema.unknown_fields"),
    ("record in the wrong file", record_in_wrong_file, "split.matches_file"),
    ("lone surrogate (invalid UTF-8 text)", lone_surrogate, "text.utf8"),
    ("SFT target neither gold nor biased", inconsistent_sft_target, "sft.consistent"),
    ("a split one record short", truncated_split, "count.train"),
    ("blank question", blank_question, "text.blank"),
    ("unknown index at a person", unknown_index_at_a_person, "fairness.unknown_idx_matches"),
    ("target index at the unknown option", target_index_at_the_unknown, "fairness.target_idx_range"),
    ("leftover BBQ slot", bbq_slot, "text.template_slots"),
    ("SFT noise one item short", sft_noise_one_short, "sft.noise_share.fairness"),
]


def write_rows(cfg: Config, rows: Rows) -> None:
    for split, items in rows.items():
        path = Path(cfg.paths.data_dir) / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in items), encoding="utf-8")


def assert_rejected(cfg: Config, root: Path, rule: str) -> dict:
    """Run the stage; it must raise naming the rule, report it, and leave every other file as it was."""
    model = Path(cfg.paths.models_dir) / "sft" / "model.safetensors"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"weights written by an earlier stage")
    before = hashes(root)
    with pytest.raises(DataValidationError) as err:
        validate.run(cfg)
    assert rule in str(err.value)
    assert hashes(root) == before
    report = json.loads((Path(cfg.paths.reports_dir) / "validation.json").read_text())
    assert report["success"] is False and rule in report["failed_rules"]
    return report


@pytest.mark.parametrize(("defect", "mutate", "rule"), BROKEN, ids=[case[0] for case in BROKEN])
def test_broken_data_is_rejected_with_the_named_rule(tmp_path, clean_rows, defect, mutate, rule):
    cfg = make_cfg(tmp_path)
    rows = json.loads(json.dumps(clean_rows))
    mutate(rows)
    write_rows(cfg, rows)
    report = assert_rejected(cfg, tmp_path, rule)
    failed = next(r for r in report["rules"] if r["rule"] == rule and not r["success"])
    # Row-level rules point at the offending row (file and line).
    if failed["expectation"] not in ("expect_column_mean_to_be_between", "expect_column_sum_to_be_between"):
        assert failed["examples"] and failed["examples"][0]["file"].endswith(".jsonl")


def test_malformed_json_line_is_named_with_its_line(tmp_path, clean_rows):
    cfg = make_cfg(tmp_path)
    write_rows(cfg, clean_rows)
    path = Path(cfg.paths.data_dir) / "train.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = '{"id": "abc", "task": \n'
    path.write_text("".join(lines))
    report = assert_rejected(cfg, tmp_path, "read.json")
    failed = next(r for r in report["rules"] if r["rule"] == "read.json")
    assert failed["examples"][0]["line"] == 5 and failed["examples"][0]["file"] == str(path)


def test_wrong_encoding_is_named_with_its_line(tmp_path, clean_rows):
    cfg = make_cfg(tmp_path)
    write_rows(cfg, clean_rows)
    path = Path(cfg.paths.data_dir) / "eval.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = json.dumps({**clean_rows["eval"][2], "question": "Où est le café?"}, ensure_ascii=False).encode(
        "latin-1") + b"\n"
    path.write_bytes(b"".join(lines))
    report = assert_rejected(cfg, tmp_path, "read.utf8")
    assert next(r for r in report["rules"] if r["rule"] == "read.utf8")["examples"][0]["line"] == 3


def test_missing_file_is_named(tmp_path, clean_rows):
    cfg = make_cfg(tmp_path)
    write_rows(cfg, {"train": clean_rows["train"]})
    assert_rejected(cfg, tmp_path, "read.missing_file")


def test_clean_data_passes_and_writes_every_report(tmp_path, clean_rows, monkeypatch):
    monkeypatch.chdir(tmp_path)  # GX must not leave a gx/ folder or anything else behind
    cfg = make_cfg(tmp_path, data_docs=True)
    write_rows(cfg, clean_rows)
    skipped = {"file": "raw.jsonl", "category": "Age", "reason": "no unknown option", "count": 2}
    sources = {"fairness": {"source": "bbq", "path": "raw", "skipped": [skipped]}}
    (tmp_path / "data" / "sources.json").write_text(json.dumps(sources))  # what `grpo prepare` writes beside the splits
    before = hashes(tmp_path)
    assert validate.run(cfg) == 0
    reports = tmp_path / "reports"
    report = json.loads((reports / "validation.json").read_text())
    assert report["success"] is True and report["n_rows"] == 72 and report["n_failed"] == 0
    names = {rule["rule"] for rule in report["rules"]}
    assert {"required.id", "leakage.id", "leakage.text", "balance.task_mix.eval", "fairness.one_unknown_option",
            "hallucination.answer_in_context", "sft.noise_share.fairness"} <= names
    markdown = (reports / "validation.md").read_text()
    assert "PASSED" in markdown
    assert "## Raw sources" in markdown and "| fairness | raw.jsonl | Age | no unknown option | 2 |" in markdown
    assert (reports / "data_docs" / "index.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not is_lock(p)) == ["data", "reports"]
    assert sorted(p.name for p in reports.iterdir()) == ["data_docs", "validation.json", "validation.md"]
    assert hashes(tmp_path) == before


def test_data_docs_are_swapped_in_whole_and_the_old_ones_kept_until_then(tmp_path):
    """A second validation replaces the Data Docs with nothing left beside them; if the swap fails halfway, the
    previous Data Docs are still on disk (renamed aside), never deleted first."""
    final, staged = tmp_path / "data_docs", tmp_path / ".data_docs.new"
    final.mkdir()
    (final / "index.html").write_text("old")
    staged.mkdir()
    (staged / "index.html").write_text("new")
    validate._replace_dir(staged, final)
    assert (final / "index.html").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["data_docs"]
    with pytest.raises(FileNotFoundError):
        validate._replace_dir(tmp_path / "never-built", final)
    assert (tmp_path / ".data_docs.old" / "index.html").read_text() == "new"


def test_a_leftover_of_an_interrupted_swap_does_not_block_the_next(tmp_path):
    """A run killed between the two renames leaves ``.data_docs.old``: the next swap clears it first."""
    final, staged, old = tmp_path / "data_docs", tmp_path / ".data_docs.new", tmp_path / ".data_docs.old"
    for folder, text in ((final, "current"), (staged, "new"), (old, "left by a killed run")):
        folder.mkdir()
        (folder / "index.html").write_text(text)
    validate._replace_dir(staged, final)
    assert (final / "index.html").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["data_docs"]


def test_a_validation_that_fails_writing_leaves_no_staged_data_docs(tmp_path, clean_rows, monkeypatch):
    """The reports folder is made with its parents; a run that fails after building its Data Docs (here the
    reports' write) removes the staged folder and leaves no Data Docs half in place."""
    cfg = make_cfg(tmp_path, data_docs=True)
    cfg = cfg.model_copy(update={"paths": cfg.paths.model_copy(update={"reports_dir": str(tmp_path / "out" / "reports")})})
    write_rows(cfg, clean_rows)

    def disk_full(files):
        raise OSError("No space left on device")

    monkeypatch.setattr(validate, "write_atomically", disk_full)
    with pytest.raises(OSError, match="No space left"):
        validate.run(cfg)
    assert [p.name for p in (tmp_path / "out" / "reports").iterdir() if not is_lock(p)] == []
