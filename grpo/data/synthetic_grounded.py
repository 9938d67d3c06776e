"""Grounded-QA items about fictional entities: answer from the context, or abstain.

An item states one to three facts about an invented town, inventor or company and asks about one
attribute. Answerable items ask about a stated fact: the answer is a span of the context.
Unanswerable items ask about an attribute the context does not state; their answer is ABSTENTION and
their ``distractor`` is the same attribute of another entity (the confident wrong answer a
hallucinating model gives). Facts are drawn per item, so no fact can be memorised across items: only
the context can tell the answer.

Train and eval use disjoint entity-name pools, so eval asks about entities never seen in training.
"""

from __future__ import annotations

import math
import random
from functools import partial
from typing import Any, NamedTuple

from grpo.data.distinct import draw_distinct
from grpo.data.schema import ABSTENTION
from grpo.data.text import contains


class Attribute(NamedTuple):
    """One fact an entity can have: how the context states it and how the question asks for it."""

    name: str
    sentence: str
    question: str
    pool: str


FIRST_NAMES = ("Mara", "Tomas", "Ilse", "Oren", "Petra", "Caius", "Lena", "Bram", "Sofi", "Anselm")
VALUE_SURNAMES = ("Venn", "Holt", "Arden", "Crane", "Pike", "Marsh", "Quill", "Dorn", "Fenwick", "Tallis")
VALUES: dict[str, tuple[str, ...]] = {
    "place": ("Port Ilva", "Greyhaven", "Ostmere", "Kelby", "Runmoor", "Talwick", "Emberly", "Norcaster"),
    "product": (
        "blue glass",
        "wool blankets",
        "copper bells",
        "pear cider",
        "salt fish",
        "paper lanterns",
        "clay pipes",
        "cheese wheels",
    ),
    "river": ("Ostra", "Velle", "Murn", "Saskel", "Brindle", "Tove", "Carra", "Lirra"),
    "invention": (
        "folding ladder",
        "steam kettle",
        "pocket loom",
        "glass compass",
        "wind clock",
        "water lens",
        "copper press",
        "spring lock",
    ),
    "instrument": ("cello", "harp", "oboe", "lute", "flute", "drum", "horn", "viola"),
    "goods": ("garden tools", "toy trains", "ink", "clocks", "sailcloth", "lamps", "bicycles", "soap"),
}
"""Value pools of the attributes (shared by both splits; the entities are what differ)."""

# Entity-name pools: train and eval draw from disjoint halves.
NAME_PARTS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "train": {
        "town": (
            ("El", "Mar", "Tor", "Vel", "Quin", "Ash"),
            ("brook", "ford", "wick", "haven", "mere", "stead"),
        ),
        "inventor": (
            ("Aldo", "Berit", "Cyra", "Dag", "Edda", "Fitz"),
            ("Orrin", "Blackwood", "Saltire", "Hume"),
        ),
        "company": (("Hollin", "Brightwater", "Ferncastle", "Oakridge", "Copperfield"), ("Works", "Mills")),
    },
    "eval": {
        "town": (("Bry", "Cal", "Dun", "Kes"), ("holm", "by", "thorpe", "moor")),
        "inventor": (("Gunn", "Hale", "Iver", "Juno"), ("Ravensworth", "Stroud", "Penhallow")),
        "company": (("Silverlake", "Thornbury", "Wexmoor"), ("Company", "Foundry")),
    },
}

TYPES: dict[str, tuple[Attribute, ...]] = {
    "town": (
        Attribute("founder", "{e} was founded by {v}.", "Who founded {e}?", "person"),
        Attribute("year", "{e} was founded in {v}.", "In what year was {e} founded?", "year"),
        Attribute("product", "{e} is known for its {v}.", "What is {e} known for?", "product"),
        Attribute("river", "{e} lies on the {v} River.", "Which river does {e} lie on?", "river"),
    ),
    "inventor": (
        Attribute("birthplace", "{e} was born in {v}.", "Where was {e} born?", "place"),
        Attribute("invention", "{e} invented the {v}.", "What did {e} invent?", "invention"),
        Attribute("death", "{e} died in {v}.", "In what year did {e} die?", "year"),
        Attribute("instrument", "{e} played the {v}.", "Which instrument did {e} play?", "instrument"),
    ),
    "company": (
        Attribute("founder", "{e} was started by {v}.", "Who started {e}?", "person"),
        Attribute("goods", "{e} makes {v}.", "What does {e} make?", "goods"),
        Attribute("office", "{e} has its main office in {v}.", "Where is the main office of {e}?", "place"),
        Attribute("year", "{e} was started in {v}.", "In what year was {e} started?", "year"),
    ),
}
"""Entity types and the attributes each can have (the template of an item is type + attribute)."""


def _entity(rng: random.Random, kind: str, split: str) -> str:
    first, second = NAME_PARTS[split][kind]
    joiner = "" if kind == "town" else " "
    return f"{rng.choice(first)}{joiner}{rng.choice(second)}"


def _value(rng: random.Random, pool: str) -> str:
    if pool == "person":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(VALUE_SURNAMES)}"
    if pool == "year":
        return str(rng.randint(1700, 1990))
    return rng.choice(VALUES[pool])


def _aliases(attribute: Attribute, value: str) -> list[str]:
    if attribute.pool == "person":
        return [value.split()[-1]]
    if attribute.pool == "river":
        return [f"{value} River"]
    return []


def _item(rng: random.Random, split: str, answerable: bool) -> dict[str, Any]:
    kind = rng.choice(sorted(TYPES))
    entity, attributes = _entity(rng, kind, split), TYPES[kind]
    asked = rng.choice(attributes)
    values = {attribute.name: _value(rng, attribute.pool) for attribute in attributes}
    others = [attribute for attribute in attributes if attribute is not asked]
    stated = rng.sample(others, rng.randint(0 if answerable else 1, 2)) + ([asked] if answerable else [])
    rng.shuffle(stated)
    context = " ".join(a.sentence.format(e=entity, v=values[a.name]) for a in stated)
    distractor = _value(rng, asked.pool)
    # Another entity's value: never the true one, never something the context says.
    while distractor == values[asked.name] or contains(context, distractor):
        distractor = _value(rng, asked.pool)
    return {
        "task": "hallucination",
        "source": "synthetic",
        "context": context,
        "question": asked.question.format(e=entity),
        "answer": values[asked.name] if answerable else ABSTENTION,
        "aliases": _aliases(asked, values[asked.name]) if answerable else [],
        "answerable": answerable,
        "category": kind,
        "distractor": distractor,
        "template_id": f"hallucination.{kind}.{asked.name}",
    }


def generate_grounded(n: int, split: str, seed: int, answerable_fraction: float) -> list[dict[str, Any]]:
    """``n`` distinct grounded-QA items (content fields of a Record) for ``split``; same seed, same items.

    ``floor(k * answerable_fraction)`` of the first ``k`` items are answerable, for every ``k``: any
    ``n`` is balanced to within one item.
    """
    rng = random.Random(f"hallucination:{split}:{seed}")
    items, seen = [], set()
    for i in range(n):
        answerable = math.floor((i + 1) * answerable_fraction) > math.floor(i * answerable_fraction)
        item = draw_distinct(
            partial(_item, rng, split, answerable),
            seen,
            f"synthetic grounded-QA generator ({split} item {i} of {n})",
            "lower data.n_train/data.n_eval",
        )
        items.append(item)
    return items
