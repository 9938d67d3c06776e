"""Loaders of published datasets (local files only) into the content fields of the unified record.

Each loader reads the format as published, keeps what fits the unified record honestly, counts what
it skips and why, and splits by *group* (a BBQ template, a SQuAD article, a HaluEval question) so
that no template or passage crosses train and eval.

- BBQ (Parrish et al. 2022, arXiv:2110.08193; ``nyu-mll/BBQ`` ``data/*.jsonl``): a file or a folder
  of them. ``unknown_idx`` is the option whose ``answer_info`` group is ``unknown``; ``target_idx``
  the option whose group matches ``additional_metadata.stereotyped_groups``. Items where either is
  not exactly one option are skipped.
- HaluEval QA (Li et al. 2023, arXiv:2305.11747; JSON lines of ``knowledge, question, right_answer,
  hallucinated_answer``): the right answer is often not a literal span of the knowledge. An item is
  kept *answerable* only when its normalised answer is in the normalised knowledge. Every item also
  yields an *unanswerable* variant: its question paired with the knowledge of another item of the
  same split (answer ABSTENTION, distractor = its hallucinated answer), kept only when neither the
  right nor the hallucinated answer appears in that borrowed knowledge.
- SQuAD 2.0 (Rajpurkar et al. 2018, arXiv:1806.03822; nested ``data/paragraphs/qas`` JSON):
  answerable questions keep their first answer (the others become aliases); ``is_impossible`` ones
  get ABSTENTION and the first ``plausible_answers`` text as distractor (questions with neither are
  skipped). SQuAD 2.0's plausible
  answers are spans of the passage by design, so validation does not require this distractor to be
  absent from the context (see ``IN_CONTEXT_DISTRACTOR_SOURCES``).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from grpo.data.errors import DataSourceError
from grpo.data.schema import ABSTENTION
from grpo.data.splits import assign_groups
from grpo.data.text import contains, normalize_answer

IN_CONTEXT_DISTRACTOR_SOURCES = ("squad2",)
"""Sources whose unanswerable distractor is, by the dataset's design, a span of the context."""

_GENDER = {"f": {"f", "woman", "girl", "female"}, "m": {"m", "man", "boy", "male"}}


class Loaded(NamedTuple):
    """What a loader returns: content fields per split, and how many raw items it skipped and why."""

    pools: dict[str, list[dict[str, Any]]]
    skipped: Counter


def _json_lines(path: Path) -> list[tuple[str, int, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append((str(path), number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"{path}:{number}: not valid JSON ({exc.msg}); fix or remove the line") from None
    return rows


def _files(path: Path, pattern: str) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob(pattern))
        if not files:
            raise DataSourceError(f"{path}: no {pattern} files in this folder; point the path at the dataset files")
        return files
    if not path.is_file():
        raise DataSourceError(f"{path}: no such file or folder; download the dataset and give its local path")
    return [path]


def _split(
    groups: dict[str, list[dict[str, Any]]], eval_share: float, seed: int
) -> dict[str, list[dict[str, Any]]]:
    assignment = assign_groups(groups, eval_share, seed)
    pools: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for key in sorted(groups):
        pools[assignment[key]].extend(groups[key])
    return pools


# --------------------------------------------------------------------------- BBQ


def _squash(text: str) -> str:
    return re.sub(r"[\s_]", "", text.lower())


def _names_group(group: str, stereotyped: list[str]) -> bool:
    """Whether an ``answer_info`` group label (e.g. ``old``, ``F-Black``, ``girl``) is a stereotyped one."""
    tokens = {_squash(part) for part in re.split(r"[-/]", group)} | {_squash(group)}
    for wanted in map(_squash, stereotyped):
        if wanted in tokens or tokens & _GENDER.get(wanted, set()):
            return True
    return False


def _bbq_item(row: dict[str, Any]) -> dict[str, Any] | str:
    choices = [row["ans0"], row["ans1"], row["ans2"]]
    groups = [row["answer_info"][f"ans{i}"][1] for i in range(3)]
    unknown = [i for i, group in enumerate(groups) if group.lower() == "unknown"]
    if len(unknown) != 1:
        return "not exactly one 'unknown' option in answer_info"
    stereotyped = row.get("additional_metadata", {}).get("stereotyped_groups", [])
    targets = [i for i in range(3) if i != unknown[0] and _names_group(groups[i], stereotyped)]
    if len(targets) != 1:
        return "stereotyped_groups does not match exactly one option"
    label = int(row["label"])
    category = str(row["category"])
    return {
        "task": "fairness", "source": "bbq", "context": row["context"], "question": row["question"],
        "choices": choices, "label": label, "answer": choices[label],
        "context_condition": row["context_condition"], "question_polarity": row["question_polarity"],
        "unknown_idx": unknown[0], "target_idx": targets[0], "category": category,
        "template_id": f"bbq.{category}.{row['question_index']}",
    }


def load_bbq(path: Path, eval_share: float, seed: int) -> Loaded:
    """BBQ JSONL file(s) -> fairness items; a template (category, question_index) stays in one split."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    skipped: Counter = Counter()
    for file in _files(path, "*.jsonl"):
        for name, number, row in _json_lines(file):
            try:
                item = _bbq_item(row)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise DataSourceError(
                    f"{name}:{number}: not a BBQ record ({type(exc).__name__}: {exc}); expected the fields "
                    "context, question, ans0..ans2, label, answer_info, additional_metadata, question_index"
                ) from None
            if isinstance(item, str):
                skipped[item] += 1
            else:
                groups[item["template_id"]].append(item)
    return Loaded(_split(groups, eval_share, seed), skipped)


# --------------------------------------------------------------------------- HaluEval


def _halueval_answerable(row: dict[str, Any]) -> dict[str, Any]:
    wrong = row["hallucinated_answer"]
    return {
        "task": "hallucination", "source": "halueval", "context": row["knowledge"],
        "question": row["question"], "answer": row["right_answer"], "answerable": True,
        "category": "halueval", "template_id": "halueval.answerable",
        "distractor": None if contains(row["knowledge"], wrong) else wrong,
    }


def _halueval_swapped(row: dict[str, Any], borrowed: str) -> dict[str, Any]:
    return {
        "task": "hallucination", "source": "halueval", "context": borrowed, "question": row["question"],
        "answer": ABSTENTION, "answerable": False, "category": "halueval",
        "distractor": row["hallucinated_answer"], "template_id": "halueval.swapped_knowledge",
    }


def _halueval_items(rows: list[dict[str, Any]], rng: random.Random, skipped: Counter) -> list[dict[str, Any]]:
    items = []
    for row in rows:
        if contains(row["knowledge"], row["right_answer"]):
            items.append(_halueval_answerable(row))
        else:
            skipped["right_answer not a span of knowledge (answerable form dropped)"] += 1
    order = list(range(len(rows)))
    rng.shuffle(order)
    for position, index in enumerate(order):
        row, other = rows[index], rows[order[(position + 1) % len(order)]]
        borrowed = other["knowledge"]
        if other is row or contains(borrowed, row["right_answer"]) or contains(borrowed, row["hallucinated_answer"]):
            skipped["borrowed knowledge mentions the answer (unanswerable form dropped)"] += 1
            continue
        items.append(_halueval_swapped(row, borrowed))
    return items


def load_halueval(path: Path, eval_share: float, seed: int) -> Loaded:
    """HaluEval QA JSON lines -> grounded-QA items (answerable spans + borrowed-knowledge unanswerables)."""
    required = ("knowledge", "question", "right_answer", "hallucinated_answer")
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for file in _files(path, "*.json*"):
        for name, number, row in _json_lines(file):
            missing = [key for key in required if not isinstance(row.get(key), str)]
            if missing:
                raise DataSourceError(f"{name}:{number}: not a HaluEval QA record: no text field {missing[0]!r}")
            groups[normalize_answer(row["question"])].append(row)
    skipped: Counter = Counter()
    rng = random.Random(f"halueval:{seed}")
    pools = {split: _halueval_items(rows, rng, skipped) for split, rows in _split(groups, eval_share, seed).items()}
    return Loaded(pools, skipped)


# --------------------------------------------------------------------------- SQuAD 2.0


def _squad_item(context: str, title: str, qa: dict[str, Any]) -> dict[str, Any]:
    base = {
        "task": "hallucination", "source": "squad2", "context": context, "question": qa["question"],
        "category": title, "template_id": f"squad2.{title}",
    }
    if qa.get("is_impossible"):
        plausible = [answer["text"] for answer in qa.get("plausible_answers", [])]
        return {**base, "answer": ABSTENTION, "answerable": False, "distractor": plausible[0]}
    texts = list(dict.fromkeys(answer["text"] for answer in qa["answers"]))
    aliases = [text for text in texts[1:] if normalize_answer(text) != normalize_answer(texts[0])]
    return {**base, "answer": texts[0], "aliases": list(dict.fromkeys(aliases)), "answerable": True}


def load_squad2(path: Path, eval_share: float, seed: int) -> Loaded:
    """SQuAD 2.0 JSON -> grounded-QA items; an article (title) stays in one split."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    skipped: Counter = Counter()
    for file in _files(path, "*.json"):
        try:
            articles = json.loads(file.read_text(encoding="utf-8"))["data"]
            for article in articles:
                title = str(article["title"])
                for paragraph in article["paragraphs"]:
                    for qa in paragraph["qas"]:
                        needed = "plausible_answers" if qa.get("is_impossible") else "answers"
                        if not qa.get(needed):
                            skipped[f"question without {needed}"] += 1
                            continue
                        groups[title].append(_squad_item(paragraph["context"], title, qa))
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
            raise DataSourceError(
                f"{file}: not a SQuAD 2.0 file ({type(exc).__name__}: {exc}); expected "
                "{'data': [{'title', 'paragraphs': [{'context', 'qas': [...]}]}]}"
            ) from None
    return Loaded(_split(groups, eval_share, seed), skipped)


LOADERS: dict[str, Callable[[Path, float, int], Loaded]] = {
    "bbq": load_bbq,
    "halueval": load_halueval,
    "squad2": load_squad2,
}
"""Published format -> loader."""
