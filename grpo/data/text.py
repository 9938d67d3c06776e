"""Text normalisation and predicates shared by the generators, loaders, validation and rewards."""

from __future__ import annotations

import hashlib
import re
import string

from grpo.data.schema import UNKNOWN_PHRASES

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
# Typographic quotes would otherwise survive punctuation removal ("don’t" != "dont").
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def normalize_answer(text: str) -> str:
    """SQuAD normalisation (Rajpurkar et al., arXiv:1606.05250): lower case, no punctuation, no
    articles a/an/the, single spaces. The one text normalisation of the project: the reward's exact
    match, the generators, the loaders and the data checks all compare through it."""
    text = text.translate(_QUOTES).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


_UNKNOWN = frozenset(normalize_answer(phrase) for phrase in UNKNOWN_PHRASES)


def contains(text: str, span: str) -> bool:
    """Whether the normalised ``span`` is a run of whole words of the normalised ``text``.

    Whole words, so that "art" is not found in "party"; normalised as the reward's exact match is
    (SQuAD: case, punctuation and articles ignored), so "answer in context" means what the reward means.
    """
    needle = normalize_answer(span)
    return bool(needle) and f" {needle} " in f" {normalize_answer(text)} "


def is_unknown_phrase(option: str) -> bool:
    """Whether an option is one of BBQ's ten "unknown" phrasings (up to case and punctuation)."""
    return normalize_answer(option) in _UNKNOWN


def text_key(context: str, question: str) -> str:
    """Hash of the normalised (context, question): equal for texts that differ only in case or punctuation."""
    payload = normalize_answer(context) + "\x1f" + normalize_answer(question)
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:16]
