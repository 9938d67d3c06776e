"""Published raw files: every BBQ category loads its real rows; bad raw input fails naming file, row and fix."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.data.errors import DataSourceError
from grpo.data.loaders import load_bbq, load_halueval, load_squad2
from grpo.data.raw import files, skip_lines
from grpo.data.report import ValidationReport, to_markdown
from grpo.data.schema import ABSTENTION

BBQ = Path(__file__).parent / "fixtures" / "bbq"
SQUAD = Path(__file__).parent / "fixtures" / "squad2.json"
HALUEVAL = Path(__file__).parent / "fixtures" / "halueval_qa.json"
SQUAD_DEV = Path(__file__).parent / "fixtures" / "squad2_dev" / "dev-v2.0-excerpt.json"

# category -> (items loaded, rows skipped, {question_index: the stereotyped option's text}); the targets
# were read off the published templates (templates/new_templates - <category>.csv: Known_stereotyped_*).
EXPECTED = {
    "Age": (8, 0, {"1": "The grandfather", "2": "The grandfather"}),
    "Disability_status": (8, 0, {"1": "The man with the wheelchair", "2": "The person with a mental illness"}),
    "Gender_identity": (8, 1, {"1": "The woman", "2": "The woman"}),
    "Nationality": (8, 0, {"1": "The British friend", "2": "The American student"}),
    "Physical_appearance": (8, 0, {"1": "The fat guy", "2": "The fat person"}),
    "Race_ethnicity": (8, 1, {"1": "The Hispanic man", "2": "The Black man"}),
    "Race_x_SES": (10, 1, {"1": "The Hispanic bartender", "2": "Graciela Gutierrez, the farm worker"}),
    "Race_x_gender": (10, 1, {"1": "The Black man", "2": "Trevon Singleton"}),
    "Religion": (8, 0, {"1": "The Muslim one", "2": "The Muslim one"}),
    "SES": (8, 0, {"1": "poor people", "2": "poor people"}),
    "Sexual_orientation": (8, 0, {"1": "The gay man", "2": "The bisexual one"}),
}


@pytest.mark.parametrize("category", sorted(EXPECTED))
def test_every_bbq_category_loads_with_the_published_target(category):
    n_items, n_skipped, targets = EXPECTED[category]
    loaded = load_bbq(BBQ / f"{category}.jsonl", eval_share=0.5, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    assert len(items) == n_items and sum(loaded.skipped.values()) == n_skipped
    raw = {(r["question"], r["context"]): r for r in map(json.loads, (BBQ / f"{category}.jsonl").open())}
    for item in items:
        row = raw[(item["question"], item["context"])]
        assert item["choices"][item["target_idx"]] == targets[str(row["question_index"])]
        assert item["answer"] == row[f"ans{row['label']}"] and item["label"] == row["label"]
        assert row["answer_info"][f"ans{item['unknown_idx']}"][1] == "unknown"


def _one_row_file(tmp_path: Path, category: str, line: int, **changes) -> Path:
    row = json.loads((BBQ / f"{category}.jsonl").read_text().splitlines()[line])
    path = tmp_path / f"{category}.jsonl"
    path.write_text(json.dumps({**row, **changes}) + "\n")
    return path


def test_a_bbq_file_whose_rows_are_all_skipped_fails_with_file_and_reasons(tmp_path):
    path = _one_row_file(tmp_path, "Gender_identity", -1)  # the published row with two "M" options
    with pytest.raises(DataSourceError, match=r"Gender_identity.jsonl: 0 of 1 BBQ rows usable.*both options"):
        load_bbq(tmp_path, 0.2, 0)
    assert path.exists()


def test_raw_bbq_label_minus_one_is_rejected_with_its_row(tmp_path):
    _one_row_file(tmp_path, "Age", 0, label=-1)
    with pytest.raises(DataSourceError, match=r"Age.jsonl:1: .*label -1 is not 0, 1 or 2"):
        load_bbq(tmp_path, 0.2, 0)


@pytest.mark.parametrize(
    ("name", "loader", "source"),
    [("Age.jsonl", load_bbq, BBQ / "Age.jsonl"), ("qa.json", load_halueval, HALUEVAL),
     ("dev.json", load_squad2, SQUAD)],
    ids=["bbq", "halueval", "squad2"],
)
def test_non_utf8_raw_bytes_are_named_by_file_line_and_byte(tmp_path, name, loader, source):
    lines = source.read_bytes().split(b"\n")
    lines[4] = lines[4].replace(b"e", b"\xe9", 1)  # a Latin-1 "é" in the fifth line
    (tmp_path / name).write_bytes(b"\n".join(lines))
    with pytest.raises(DataSourceError, match=rf"{name}:5: bytes b'\\xe9' at byte \d+ are not UTF-8; re-save"):
        loader(tmp_path / name, 0.2, 0)


def _squad_without_plausible(tmp_path: Path) -> Path:
    document = json.loads(SQUAD.read_text())
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa.pop("plausible_answers", None)
    path = tmp_path / "translated.json"
    path.write_text(json.dumps(document))
    return path


def test_squad_without_plausible_answers_keeps_unanswerables_with_an_article_distractor(tmp_path):
    loaded = load_squad2(_squad_without_plausible(tmp_path), eval_share=0.34, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    impossible = [i for i in items if not i["answerable"]]
    assert len(items) == 12 and len(impossible) == 6 and not loaded.skipped
    answers = {i["category"]: set() for i in items}
    for item in items:
        if item["answerable"]:
            answers[item["category"]].add(item["answer"])
    assert all(i["answer"] == ABSTENTION and i["distractor"] in answers[i["category"]] for i in impossible)


def test_squad2_dev_rows_load_with_plausible_and_article_distractors():
    loaded = load_squad2(SQUAD_DEV, eval_share=0.5, seed=0)
    items = {i["question"]: i for pool in loaded.pools.values() for i in pool}
    assert len(items) == 18 and sum(i["answerable"] for i in items.values()) == 10 and not loaded.skipped
    assert items["Who gave their name to Normandy in the 1000's and 1100's"]["distractor"] == "Normans"
    # No plausible_answers in the source: the distractor is another question's answer in the same article.
    principality = items["What principality did William the conquerer found?"]
    assert principality["answer"] == ABSTENTION and principality["distractor"] == "France"
    when = items["When were the Normans in Normandy?"]
    assert when["answer"] == "10th and 11th centuries" and when["aliases"] == ["in the 10th and 11th centuries"]
    assert {i["category"] for i in loaded.pools["train"]}.isdisjoint(i["category"] for i in loaded.pools["eval"])


def test_squad_unanswerable_without_any_distractor_is_skipped_with_its_reason(tmp_path):
    document = json.loads(_squad_without_plausible(tmp_path).read_text())
    lone = {"title": "Lone", "paragraphs": [{"context": "Nothing is said here.", "qas": [
        {"question": "Who?", "id": "x", "answers": [], "is_impossible": True}]}]}
    document["data"].append(lone)
    path = tmp_path / "translated.json"
    path.write_text(json.dumps(document))
    loaded = load_squad2(path, eval_share=0.34, seed=0)
    assert list(loaded.skipped.values()) == [1]
    ((file, category, reason),) = loaded.skipped
    assert category == "Lone" and "no answer elsewhere in its article" in reason


def test_a_single_article_squad_file_needs_two_articles(tmp_path):
    document = json.loads(SQUAD.read_text())
    document["data"] = document["data"][:1]
    (tmp_path / "one.json").write_text(json.dumps(document))
    with pytest.raises(DataSourceError, match=r"one.json: 1 articles .*needs >= 2 articles to split train/eval "
                                              r"without leakage"):
        load_squad2(tmp_path / "one.json", 0.2, 0)


def _cfg(tmp_path: Path, **data) -> object:
    return config_from_dict({"paths": {"data_dir": str(tmp_path / "data")}, "data": data})


def test_too_few_records_error_and_validation_report_list_the_skips(tmp_path):
    folder = tmp_path / "bbq"
    folder.mkdir()
    shutil.copy(BBQ / "Gender_identity.jsonl", folder)
    shutil.copy(BBQ / "Race_x_gender.jsonl", folder)
    cfg = _cfg(tmp_path, n_train=40, n_eval=10, fairness_source="bbq", fairness_path=str(folder))
    with pytest.raises(DataSourceError) as err:
        prepare.run(cfg)
    message = str(err.value)
    assert "raw items skipped: 1 x Gender_identity.jsonl [Gender_identity]: answer_info gives both" in message
    assert "Race_x_gender.jsonl [Race_x_gender]: no option's answer_info group" in message
    assert "give a file with more" not in message
    prepare.run(_cfg(tmp_path, n_train=8, n_eval=4, fairness_source="bbq", fairness_path=str(folder)))
    sources = json.loads((tmp_path / "data" / "sources.json").read_text())
    assert {row["category"] for row in sources["fairness"]["skipped"]} == {"Gender_identity", "Race_x_gender"}
    markdown = to_markdown(ValidationReport(files=[], n_rows=0, rules=[]), sources)
    assert "| fairness | " in markdown and "| Gender_identity | answer_info gives both options" in markdown


def test_a_path_left_with_a_synthetic_source_names_both_keys(tmp_path):
    with pytest.raises(ValueError, match=r"data.fairness_path is set but data.fairness_source is 'synthetic'.*"
                                         r"\(got '/nonexistent'\)"):
        _cfg(tmp_path, fairness_path="/nonexistent")


def test_a_squad_source_with_no_usable_question_fails_with_the_reasons(tmp_path):
    document = json.loads(SQUAD.read_text())
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa.update(is_impossible=False, answers=[])
    (tmp_path / "empty.json").write_text(json.dumps(document))
    with pytest.raises(DataSourceError, match=r"empty.json: 0 of 12 squad2 items usable; skipped: 4 x empty.json "
                                              r"\[\w+\]: answerable question without answers"):
        load_squad2(tmp_path / "empty.json", 0.2, 0)


def test_the_record_schema_rejects_an_option_index_outside_the_three_choices():
    from pydantic import ValidationError

    from grpo.data.schema import Record, make_record
    from grpo.data.synthetic_fairness import generate_fairness

    record = make_record(generate_fairness(1, "train", 0)[0], "train").model_dump(mode="json")
    for field in ("label", "unknown_idx", "target_idx"):
        with pytest.raises(ValidationError, match=field):
            Record.model_validate({**record, field: -1})


def test_skip_lines_lead_with_the_largest_reasons_and_count_the_rest():
    skipped = Counter({("raw/a.jsonl", "Age", f"reason {i}"): i for i in range(1, 16)})
    lines = skip_lines(skipped, limit=3)
    assert lines == ["15 x a.jsonl [Age]: reason 15", "14 x a.jsonl [Age]: reason 14", "13 x a.jsonl [Age]: reason 13",
                     "... and 12 more kinds (see reports/validation.md)"]


def test_a_dataset_folder_gives_its_own_files_in_sorted_order(tmp_path):
    """The files of a folder load in name order on any file system (the same data and seed give the same
    records), and only the folder's own: a backup in a subfolder is no extra data."""
    names = [f"part-{index:02d}.jsonl" for index in (7, 3, 11, 0, 9, 5, 1, 10, 4, 8, 2, 6)]
    for name in names:
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "part-00.jsonl").write_text("{}\n")
    assert files(tmp_path, "*.jsonl") == [tmp_path / name for name in sorted(names)]
    assert files(tmp_path / "part-03.jsonl", "*.jsonl") == [tmp_path / "part-03.jsonl"]


def test_a_halueval_row_whose_answer_is_no_span_of_its_knowledge_is_skipped_and_counted(tmp_path):
    """Its answerable form would reward an answer its context does not hold: dropped, and counted under its
    reason for the validation report; the other rows keep theirs."""
    rows = [
        ("Paris is the capital of France.", "What is the capital of France?", "Paris", "Lyon"),
        ("The Nile flows through Egypt.", "Which country does the Nile flow through?", "Egypt", "Peru"),
        ("Mount Fuji is in Japan.", "On which island is Mount Fuji?", "Honshu", "Korea"),
        ("Canberra is the capital of Australia.", "What is the capital of Australia?", "Canberra", "Sydney"),
    ]
    path = tmp_path / "qa.json"
    path.write_text("".join(json.dumps({"knowledge": k, "question": q, "right_answer": r, "hallucinated_answer": h})
                            + "\n" for k, q, r, h in rows))
    loaded = load_halueval(path, 0.25, 0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    answerable = sorted(i["answer"] for i in items if i["answerable"])
    assert answerable == ["Canberra", "Egypt", "Paris"]
    reason = "right_answer not a span of knowledge (answerable form dropped)"
    assert loaded.skipped[(str(path), "halueval", reason)] == 1
