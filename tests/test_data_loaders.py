"""grpo/data/loaders.py: each published format round-trips its fixture into records that pass the suite."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.data.bbq import _names_group
from grpo.data.errors import DataSourceError
from grpo.data.loaders import load_bbq, load_halueval, load_squad2
from grpo.data.schema import ABSTENTION
from grpo.data.text import contains
from grpo.data.validate import validate_files

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("data", "source"),
    [
        ({"fairness_source": "bbq", "fairness_path": str(FIXTURES / "bbq")}, "bbq"),
        ({"hallucination_source": "halueval", "hallucination_path": str(FIXTURES / "halueval_qa.json")}, "halueval"),
        ({"hallucination_source": "squad2", "hallucination_path": str(FIXTURES / "squad2.json")}, "squad2"),
        ({"hallucination_source": "squad2", "hallucination_path": str(FIXTURES / "squad2_dev")}, "squad2"),
    ],
    ids=["bbq", "halueval", "squad2", "squad2-dev-excerpt"],
)
def test_fixture_round_trips_into_records_that_pass_the_suite(tmp_path, data, source):
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data")},
                            "data": {"n_train": 8, "n_eval": 4, "sft_noise": 0.5, **data}})
    prepare.run(cfg)
    files = {split: tmp_path / "data" / f"{split}.jsonl" for split in ("train", "eval")}
    records = [json.loads(line) for path in files.values() for line in path.read_text().splitlines()]
    assert sum(r["source"] == source for r in records) == 6
    report = validate_files(files, cfg)
    assert report.success, [(r.rule, r.examples[:1], r.observed) for r in report.failures]


@pytest.mark.parametrize(
    ("group", "stereotyped", "expected"),
    [
        # answer_info group label, stereotyped_groups, is it the stereotyped one
        ("old", ["old"], True),
        ("nonOld", ["old"], False),
        ("girl", ["F"], True),
        ("woman", ["F"], True),
        ("M", ["F"], False),
        ("F-Black", ["Black"], True),
        ("lowSES", ["low SES"], True),
        ("highSES", ["low SES"], False),
        ("trans_F", ["transgender women", "trans"], True),
        ("nonTrans_F", ["transgender women", "trans"], False),
    ],
)
def test_bbq_group_matching(group, stereotyped, expected):
    assert _names_group(group, stereotyped) is expected


def test_bbq_indices_skips_and_template_split():
    loaded = load_bbq(FIXTURES / "bbq", eval_share=0.25, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    assert len(items) == 92 and sum(loaded.skipped.values()) == 4
    grandfather = next(i for i in items if i["template_id"] == "bbq.Age.1" and i["context_condition"] == "disambig"
                       and i["question_polarity"] == "neg")
    assert grandfather["unknown_idx"] == 2 and grandfather["target_idx"] == 0  # "old" is the grandfather
    assert grandfather["answer"] == "The grandson" == grandfather["choices"][grandfather["label"]]
    train_templates = {i["template_id"] for i in loaded.pools["train"]}
    eval_templates = {i["template_id"] for i in loaded.pools["eval"]}
    assert train_templates and eval_templates and not train_templates & eval_templates


@pytest.mark.parametrize("label", [True, 3, "1"], ids=["json-true", "out-of-range", "string"])
def test_a_bbq_label_that_is_not_an_option_index_names_the_line_and_the_value(tmp_path, label):
    """``label`` must be the index 0, 1 or 2 of the gold option: JSON ``true`` (which Python would take
    as 1), 3 or a string is an error naming the file, the line, the field and the value, never an item."""
    rows = (FIXTURES / "bbq" / "Age.jsonl").read_text().splitlines()[:3]
    bad = json.loads(rows[1]) | {"label": label}
    folder = tmp_path / "bbq"
    folder.mkdir()
    (folder / "Age.jsonl").write_text("\n".join([rows[0], json.dumps(bad), rows[2]]) + "\n")
    with pytest.raises(DataSourceError, match=rf"Age.jsonl:2: not a BBQ record .*label {label!r} is not 0, 1 or 2"):
        load_bbq(folder, eval_share=0.25, seed=0)


def test_halueval_keeps_spans_and_borrows_knowledge_for_unanswerables():
    loaded = load_halueval(FIXTURES / "halueval_qa.json", eval_share=0.25, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    answerable = [i for i in items if i["answerable"]]
    unanswerable = [i for i in items if not i["answerable"]]
    assert len(answerable) == 9  # three right answers are no span of their knowledge
    assert not any(i["question"].startswith("Musician and satirist Allie Goertz") for i in answerable)
    raw = {json.loads(line)["question"]: json.loads(line) for line in (FIXTURES / "halueval_qa.json").open()}
    for item in unanswerable:
        assert item["answer"] == ABSTENTION
        assert item["context"] != raw[item["question"]]["knowledge"]
        assert item["distractor"] == raw[item["question"]]["hallucinated_answer"]
    assert {i["template_id"] for i in answerable} == {"halueval.answerable"}  # the by-kind table's two kinds
    assert {i["template_id"] for i in unanswerable} == {"halueval.swapped_knowledge"}
    for split, pool in loaded.pools.items():  # knowledge is borrowed within the split only
        own = {raw[i["question"]]["knowledge"] for i in pool}
        assert all(i["context"] in own for i in pool), split


def test_halueval_borrows_no_knowledge_that_holds_the_right_answer(tmp_path):
    cities = ["Lyon", "Porto", "Graz", "Turku"]
    rows = [{"knowledge": f"{city} has a river. " + " ".join(f"{c} is old." for c in cities),
             "question": f"Which city has river {i}?", "right_answer": city, "hallucinated_answer": f"Zork{i}"}
            for i, city in enumerate(cities)]
    path = tmp_path / "qa_data.json"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_halueval(path, eval_share=0.25, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    assert len(items) == 4 and all(i["answerable"] for i in items)  # every other knowledge names each answer
    assert sum(n for (_, _, reason), n in loaded.skipped.items() if reason.startswith("borrowed")) == 4


def _halueval_file(tmp_path, rows: list[dict]) -> Path:
    path = tmp_path / "qa_data.json"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_halueval_copies_of_a_question_share_a_split_and_no_context_states_a_distractor(tmp_path):
    """The same question written twice (case, punctuation) lands in one split, as the leak check reads it; an
    unanswerable item never borrows knowledge that states its hallucinated answer, and an answerable item's
    distractor is never one its own knowledge states."""
    towns = ["Lyon", "Porto", "Graz", "Turku", "Ghent", "Bergen", "Split", "Tartu", "Cork", "Brno"]
    rows = []
    for i, town in enumerate(towns):
        wrong = f"Zork{i}"
        knowledge = f"{town} was founded by Mara{i}." + (f" Nobody there knows {towns[(i + 1) % 10]}'s Zork{i - 1}."
                                                          if i % 2 else "")
        question = f"Who founded {town}?"
        rows += [{"knowledge": knowledge, "question": q, "right_answer": f"Mara{i}", "hallucinated_answer": wrong}
                 for q in (question, question.lower().rstrip("?") + " !")]
    rows[4]["knowledge"] += " Zork2 is a rumour."  # its own distractor stated in its own knowledge
    loaded = load_halueval(_halueval_file(tmp_path, rows), eval_share=0.3, seed=0)
    split_of: dict[str, set[str]] = {}
    for split, pool in loaded.pools.items():
        for item in pool:
            split_of.setdefault(item["question"].lower().strip("?! "), set()).add(split)
    assert all(len(splits) == 1 for splits in split_of.values()), split_of
    items = loaded.pools["train"] + loaded.pools["eval"]
    assert not [i for i in items if not i["answerable"] and contains(i["context"], i["distractor"])]
    stated = [i for i in items if i["answerable"] and i["context"] == rows[4]["knowledge"]]
    assert stated and all(i["distractor"] is None for i in stated)


def test_a_halueval_file_of_unusable_rows_or_null_fields_names_the_file(tmp_path):
    """Rows none of which gives an item are an error naming the file and the reasons; a field that is not text
    (null) is named as a missing text field."""
    rows = [{"knowledge": "Every town has a river.", "question": f"Who founded town {i}?",
             "right_answer": f"Mara{i}", "hallucinated_answer": "river"} for i in range(6)]
    with pytest.raises(DataSourceError, match=r"0 of 6 halueval items usable; skipped: "):
        load_halueval(_halueval_file(tmp_path, rows), eval_share=0.3, seed=0)
    rows[0]["knowledge"] = None
    with pytest.raises(DataSourceError, match=r"qa_data.json:1: not a HaluEval QA record: no text field 'knowledge'"):
        load_halueval(_halueval_file(tmp_path, rows), eval_share=0.3, seed=0)


def test_squad2_answers_aliases_distractors_and_article_split():
    loaded = load_squad2(FIXTURES / "squad2.json", eval_share=0.34, seed=0)
    items = loaded.pools["train"] + loaded.pools["eval"]
    assert len(items) == 12
    impossible = [i for i in items if not i["answerable"]]
    assert len(impossible) == 6 and all(i["answer"] == ABSTENTION and i["distractor"] for i in impossible)
    lind = next(i for i in items if i["question"] == "Who opened the glassworks of Vell?")
    assert lind["answer"] == "Oskar Lind" and lind["answerable"]
    titles = {split: {i["category"] for i in pool} for split, pool in loaded.pools.items()}
    assert len(titles["eval"]) == 1 and not titles["train"] & titles["eval"]


def _answerable(question: str, context: str, *texts: str) -> dict:
    answers = [{"text": text, "answer_start": context.index(text)} for text in texts]
    return {"question": question, "id": question, "answers": answers, "is_impossible": False}


def test_squad2_gold_answer_is_a_whole_word_span_else_the_question_is_skipped(tmp_path):
    # SQuAD answers are character spans that may cut a word, as in dev-v2.0's Normans article:
    # "Rollo" of "Rollo's", "the Adriatic" of "Adriatic—fell" (an em dash is no ASCII punctuation).
    normans = ("The treaty gave Rollo's Vikings the lower Seine. Dyrrachium—one of the most important "
               "naval bases of the Adriatic—fell again to Byzantine hands.")
    glass = "The glassworks of Vell were opened in 1788 by the merchant Oskar Lind."
    articles = [
        {"title": "Normans", "paragraphs": [{"context": normans, "qas": [
            _answerable("Whose Vikings got the lower Seine?", normans, "Rollo", "Rollo's Vikings"),
            _answerable("Where was Dyrrachium?", normans, "the Adriatic", "Adriatic"),
        ]}]},
        {"title": "Glassworks_of_Vell", "paragraphs": [{"context": glass, "qas": [
            _answerable("Who opened the glassworks of Vell?", glass, "Oskar Lind", "the merchant Oskar Lind"),
        ]}]},
    ]
    path = tmp_path / "squad.json"
    path.write_text(json.dumps({"version": "v2.0", "data": articles}, ensure_ascii=False))
    loaded = load_squad2(path, eval_share=0.5, seed=0)
    items = {i["question"]: i for i in loaded.pools["train"] + loaded.pools["eval"]}
    assert set(items) == {"Whose Vikings got the lower Seine?", "Who opened the glassworks of Vell?"}
    seine = items["Whose Vikings got the lower Seine?"]
    assert seine["answer"] == "Rollo's Vikings" and seine["aliases"] == ["Rollo"]
    lind = items["Who opened the glassworks of Vell?"]
    assert lind["answer"] == "Oskar Lind" and lind["aliases"] == ["the merchant Oskar Lind"]
    assert all(contains(i["context"], i["answer"]) for i in items.values())
    assert loaded.skipped == {(str(path), "Normans", "no answer is a whole-word span of the context"): 1}


def test_missing_and_malformed_sources_name_the_file(tmp_path):
    with pytest.raises(DataSourceError, match="nope.jsonl"):
        load_bbq(tmp_path / "nope.jsonl", 0.2, 0)
    bad = tmp_path / "qa.json"
    bad.write_text('{"knowledge": "k", "question": "q", "right_answer": "a", "hallucinated_answer": "b"}\n{oops\n')
    with pytest.raises(DataSourceError, match=r"qa.json:2"):
        load_halueval(bad, 0.2, 0)
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(DataSourceError, match="knowledge"):
        load_halueval(bad, 0.2, 0)


def test_every_file_of_a_folder_must_give_an_item(tmp_path):
    """A SQuAD 2.0 or HaluEval file that gives nothing is an error naming it, even beside good files
    (BBQ's loader does the same); a HaluEval folder's other task files are named with the fix."""
    squad = tmp_path / "squad"
    squad.mkdir()
    shutil.copy(FIXTURES / "squad2.json", squad / "a.json")
    context = "The glassworks of Vell were opened in 1788."
    useless = {"data": [{"title": "Vell", "paragraphs": [{"context": context, "qas": [
        {"id": "1", "question": "Who opened them?", "is_impossible": False, "answers": []}]}]}]}
    (squad / "b.json").write_text(json.dumps(useless))
    with pytest.raises(DataSourceError, match=r"b\.json: 0 of 1 squad2 items usable; skipped: .*without answers"):
        load_squad2(squad, 0.2, 0)
    (squad / "b.json").write_text(json.dumps({"data": [{"title": "Vell", "paragraphs": [{"context": None, "qas": [
        {"id": "1", "question": "Who?", "is_impossible": False, "answers": [{"text": "x", "answer_start": 0}]}]}]}]}))
    with pytest.raises(DataSourceError, match=r"b\.json: not a SQuAD 2.0 file"):
        load_squad2(squad, 0.2, 0)
    (squad / "b.json").write_text(json.dumps({"data": [{"title": "Vell", "paragraphs": None}]}))
    with pytest.raises(DataSourceError, match=r"b\.json: not a SQuAD 2.0 file"):
        load_squad2(squad, 0.2, 0)
    halueval = tmp_path / "halueval"
    halueval.mkdir()
    shutil.copy(FIXTURES / "halueval_qa.json", halueval / "qa_data.json")
    (halueval / "empty.json").write_text("\n")
    with pytest.raises(DataSourceError, match=r"empty\.json: no HaluEval QA record"):
        load_halueval(halueval, 0.2, 0)
    (halueval / "empty.json").write_text('{"knowledge": "k", "dialogue_history": "h", "right_response": "r"}\n')
    with pytest.raises(DataSourceError, match=r"empty\.json:1: .*point data\.hallucination_path at it"):
        load_halueval(halueval, 0.2, 0)


def test_bbq_held_out_categories_are_evaluated_and_never_trained_on():
    from grpo.data.bbq import hold_out_categories

    loaded = load_bbq(FIXTURES / "bbq", eval_share=0.25, seed=0)
    split = hold_out_categories(loaded, ["Age", "Religion"], FIXTURES / "bbq")
    assert {i["category"] for i in split.pools["eval"]} == {"Age", "Religion"}
    assert not {"Age", "Religion"} & {i["category"] for i in split.pools["train"]}
    assert len(split.pools["train"]) + len(split.pools["eval"]) == 92 and split.skipped == loaded.skipped
    with pytest.raises(DataSourceError, match=r"no category \['Agee'\].*'Age', 'Disability_status'"):
        hold_out_categories(loaded, ["Agee"], FIXTURES / "bbq")
    every = sorted({i["category"] for i in split.pools["train"] + split.pools["eval"]})
    with pytest.raises(DataSourceError, match="no category left to train on"):
        hold_out_categories(loaded, every, FIXTURES / "bbq")


def test_held_out_categories_need_bbq():
    from grpo.config import ConfigError, config_from_dict

    with pytest.raises((ConfigError, ValueError), match="only BBQ files have categories"):
        config_from_dict({"data": {"fairness_heldout_categories": ["Age"]}})
    cfg = config_from_dict({"data": {"fairness_source": "bbq", "fairness_path": str(FIXTURES / "bbq"),
                                     "fairness_heldout_categories": ["Age"]}})
    assert cfg.data.fairness_heldout_categories == ["Age"]



def test_prepare_with_held_out_categories_writes_them_to_eval_only(tmp_path):
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data")},
                            "data": {"n_train": 16, "n_eval": 8, "sft_noise": 0.5, "fairness_source": "bbq",
                                     "fairness_path": str(FIXTURES / "bbq"),
                                     "fairness_heldout_categories": ["Age", "Religion"]}})
    prepare.run(cfg)
    split = {s: [json.loads(line) for line in (tmp_path / "data" / f"{s}.jsonl").read_text().splitlines()]
             for s in ("train", "eval")}
    fair = {s: {r["category"] for r in records if r["task"] == "fairness"} for s, records in split.items()}
    assert fair["eval"] <= {"Age", "Religion"} and fair["eval"]
    assert fair["train"] and not fair["train"] & {"Age", "Religion"}
