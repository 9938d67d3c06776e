"""Loaders of published datasets (local files only) into the content fields of the unified record.

Each loader reads the format as published, keeps what fits the unified record honestly, counts what
it skips and why (per file, category and reason), and splits by *group* (a BBQ template, a SQuAD
article, a HaluEval question) so that no template or passage crosses train and eval. A file that
gives no item at all is an error naming the file and the skip reasons.

- BBQ: every category file of ``nyu-mll/BBQ`` ``data/``, see ``grpo/data/bbq.py``.
- HaluEval QA (Li et al. 2023, arXiv:2305.11747; JSON lines of ``knowledge, question, right_answer,
  hallucinated_answer``): the right answer is often not a literal span of the knowledge. An item is
  kept *answerable* only when its normalised answer is in the normalised knowledge. Every item also
  yields an *unanswerable* variant: its question paired with the knowledge of another item of the
  same split (answer ABSTENTION, distractor = its hallucinated answer), kept only when neither the
  right nor the hallucinated answer appears in that borrowed knowledge.
- SQuAD 2.0 (Rajpurkar et al. 2018, arXiv:1806.03822; nested ``data/paragraphs/qas`` JSON):
  answerable questions keep their first answer that is a whole-word span of the context (the others
  become aliases): SQuAD's answers are character spans, which may cut a word ("Rollo" of "Rollo's"),
  and validation and the reward read a gold answer as whole words; a question with no such answer is
  skipped. ``is_impossible`` ones get ABSTENTION and the first ``plausible_answers`` text as
  distractor. Files without ``plausible_answers`` (several translated SQuAD 2.0 sets) take the
  distractor from another question's answer in the same article; an unanswerable question of an
  article without any answer is skipped. SQuAD 2.0's plausible answers are spans of the passage by
  design, so validation does not require this distractor to be absent from the context (see
  ``IN_CONTEXT_DISTRACTOR_SOURCES``).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.data.bbq import load_bbq
from grpo.data.errors import DataSourceError
from grpo.data.raw import Loaded, files, json_file, json_lines, skip_lines, split_groups
from grpo.data.schema import ABSTENTION
from grpo.data.text import contains, normalize_answer

IN_CONTEXT_DISTRACTOR_SOURCES = ("squad2",)
"""Sources whose unanswerable distractor is, by the dataset's design, a span of the context."""


def _require_items(path: Path, source: str, n_items: int, n_raw: int, skipped: Counter) -> None:
    if n_items == 0:
        raise DataSourceError(
            f"{path}: 0 of {n_raw} {source} items usable; skipped: {'; '.join(skip_lines(skipped)) or 'empty file'}; "
            "check that the file is the published format"
        )


# --------------------------------------------------------------------------- HaluEval


def _halueval_answerable(row: dict[str, Any]) -> dict[str, Any]:
    wrong = row["hallucinated_answer"]
    return {
        "task": "hallucination",
        "source": "halueval",
        "context": row["knowledge"],
        "question": row["question"],
        "answer": row["right_answer"],
        "answerable": True,
        "category": "halueval",
        "template_id": "halueval.answerable",
        "distractor": None if contains(row["knowledge"], wrong) else wrong,
    }


def _halueval_swapped(row: dict[str, Any], borrowed: str) -> dict[str, Any]:
    return {
        "task": "hallucination",
        "source": "halueval",
        "context": borrowed,
        "question": row["question"],
        "answer": ABSTENTION,
        "answerable": False,
        "category": "halueval",
        "distractor": row["hallucinated_answer"],
        "template_id": "halueval.swapped_knowledge",
    }


def _halueval_items(
    rows: list[dict[str, Any]], rng: random.Random, skip: Callable[[str], None]
) -> list[dict[str, Any]]:
    items = []
    for row in rows:
        if contains(row["knowledge"], row["right_answer"]):
            items.append(_halueval_answerable(row))
        else:
            skip("right_answer not a span of knowledge (answerable form dropped)")
    order = list(range(len(rows)))
    rng.shuffle(order)
    for position, index in enumerate(order):
        row, other = rows[index], rows[order[(position + 1) % len(order)]]
        borrowed = other["knowledge"]
        if (
            other is row
            or contains(borrowed, row["right_answer"])
            or contains(borrowed, row["hallucinated_answer"])
        ):
            skip("borrowed knowledge mentions the answer (unanswerable form dropped)")
            continue
        items.append(_halueval_swapped(row, borrowed))
    return items


def load_halueval(path: Path, eval_share: float, seed: int) -> Loaded:
    """HaluEval QA JSON lines -> grounded-QA items (answerable spans + borrowed-knowledge unanswerables)."""
    required = ("knowledge", "question", "right_answer", "hallucinated_answer")
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for file in files(path, "*.json*"):
        rows = json_lines(file)
        if not rows:
            raise DataSourceError(f"{file}: no HaluEval QA record in this file; remove it from the folder")
        for name, number, row in rows:
            missing = [key for key in required if not isinstance(row.get(key), str)]
            if missing:
                raise DataSourceError(
                    f"{name}:{number}: not a HaluEval QA record: no text field {missing[0]!r}; the QA task's "
                    "file is data/qa_data.json (point data.hallucination_path at it, not at HaluEval's data/ "
                    "folder, which also holds the dialogue, summarization and general tasks)"
                )
            groups[normalize_answer(row["question"])].append(row)
    skipped: Counter = Counter()

    def skip(reason: str) -> None:
        skipped[(str(path), "halueval", reason)] += 1

    rng = random.Random(f"halueval:{seed}")
    pools = {
        split: _halueval_items(rows, rng, skip)
        for split, rows in split_groups(groups, eval_share, seed, path, "questions").items()
    }
    _require_items(path, "halueval", sum(map(len, pools.values())), sum(map(len, groups.values())), skipped)
    return Loaded(pools, skipped)


# --------------------------------------------------------------------------- SQuAD 2.0


def _squad_item(context: str, title: str, qa: dict[str, Any], fallback: str | None) -> dict[str, Any]:
    base = {
        "task": "hallucination",
        "source": "squad2",
        "context": context,
        "question": qa["question"],
        "category": title,
        "template_id": f"squad2.{title}",
    }
    if qa.get("is_impossible"):
        plausible = [answer["text"] for answer in qa.get("plausible_answers") or []]
        return {
            **base,
            "answer": ABSTENTION,
            "answerable": False,
            "distractor": plausible[0] if plausible else fallback,
        }
    texts = list(dict.fromkeys(answer["text"] for answer in qa["answers"]))
    gold = next(text for text in texts if contains(context, text))
    aliases = [text for text in texts if normalize_answer(text) != normalize_answer(gold)]
    return {**base, "answer": gold, "aliases": aliases, "answerable": True}


def _article_answers(article: dict[str, Any]) -> list[str]:
    """Every answer text of the article's answerable questions (distractors for unanswerables without any)."""
    return [
        qa["answers"][0]["text"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
        if not qa.get("is_impossible") and qa.get("answers")
    ]


def _squad_article(file: Path, article: dict[str, Any], skipped: Counter) -> list[dict[str, Any]]:
    title, items = str(article["title"]), []
    answers = _article_answers(article)
    for paragraph in article["paragraphs"]:
        for qa in paragraph["qas"]:
            own = {normalize_answer(a["text"]) for a in qa.get("answers") or []}
            fallback = next((text for text in answers if normalize_answer(text) not in own), None)
            if not qa.get("is_impossible") and not qa.get("answers"):
                skipped[(str(file), title, "answerable question without answers")] += 1
            elif not qa.get("is_impossible") and not any(
                contains(paragraph["context"], answer["text"]) for answer in qa["answers"]
            ):
                skipped[(str(file), title, "no answer is a whole-word span of the context")] += 1
            elif qa.get("is_impossible") and not qa.get("plausible_answers") and fallback is None:
                skipped[
                    (
                        str(file),
                        title,
                        "unanswerable question without plausible_answers, and no "
                        "answer elsewhere in its article to use as distractor",
                    )
                ] += 1
            else:
                items.append(_squad_item(paragraph["context"], title, qa, fallback))
    return items


def load_squad2(path: Path, eval_share: float, seed: int) -> Loaded:
    """SQuAD 2.0 JSON -> grounded-QA items; an article (title) stays in one split."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    skipped: Counter = Counter()
    for file in files(path, "*.json"):
        document = json_file(file)
        mine: Counter = Counter()
        try:
            n_file = n_items = 0
            for article in document["data"]:
                items = _squad_article(file, article, mine)
                n_file += sum(len(paragraph["qas"]) for paragraph in article["paragraphs"])
                n_items += len(items)
                if items:
                    groups[items[0]["template_id"]].extend(items)
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise DataSourceError(
                f"{file}: not a SQuAD 2.0 file ({type(exc).__name__}: {exc}); expected "
                "{'data': [{'title', 'paragraphs': [{'context', 'qas': [...]}]}]} with text fields"
            ) from None
        _require_items(file, "squad2", n_items, n_file, mine)  # every configured file gives an item
        skipped.update(mine)
    return Loaded(split_groups(groups, eval_share, seed, path, "articles"), skipped)


LOADERS: dict[str, Callable[[Path, float, int], Loaded]] = {
    "bbq": load_bbq,
    "halueval": load_halueval,
    "squad2": load_squad2,
}
"""Published format -> loader."""
