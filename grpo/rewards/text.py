"""Text helpers shared by the rewards and the evaluation: cleaning, SQuAD scoring, abstention.

``normalize_answer`` (in ``grpo/data/text.py``: the data checks and loaders use the same one), ``exact_match`` and ``f1_score`` follow the official SQuAD v1.1/v2.0 evaluation
script (Rajpurkar et al., arXiv:1606.05250): lower case, drop punctuation and the articles a/an/the,
collapse whitespace; F1 is over the bag of normalised tokens.
"""

from __future__ import annotations

import re
from collections import Counter

from grpo.data.text import normalize_answer

# Any chat special token of the templates we support (<|eot_id|>, <|im_end|>, <|end|>, ...).
_SPECIAL = re.compile(r"<\|[^<>|]{1,40}\|>|</s>|<eos>|<end_of_turn>|<start_of_turn>")
# The first of these ends the answer: text after it was never meant as part of the reply.
_END = re.compile(r"<\|(?:eot_id|im_end|end|endoftext|end_of_text)\|>|</s>|<eos>|<end_of_turn>")
_ANSWER_PREFIX = re.compile(r"^\s*answer\s*[:\-]\s*", re.IGNORECASE)
# Sentence ends: . ! ? ; followed by a space or the end (so "1.5" stays one number), or a line break.
_SENTENCE_END = re.compile(r"[.!?;]+(?:\s+|$)|\n+")

# Normalised phrases that mark a sentence as declining to answer.
ABSTENTION_PHRASES = (
    "i dont know",
    "i do not know",
    "i dont have enough information",
    "i cannot answer",
    "i cant answer",
    "cannot be determined",
    "can not be determined",
    "cant be determined",
    "cannot be answered",
    "cannot determine",
    "not enough information",
    "not enough info",
    "insufficient information",
    "no information",
    "unable to answer",
    "unanswerable",
    "context does not say",
    "context doesnt say",
    "context does not mention",
    "context doesnt mention",
    "context does not state",
    "context doesnt state",
    "context does not specify",
    "context doesnt specify",
    "context does not provide",
    "context doesnt provide",
    "context does not contain",
    "context doesnt contain",
    "not mentioned in context",
    "not stated in context",
    "not specified in context",
    "not provided in context",
    "not given in context",
    "no answer",
)
# Short replies that abstain only when they are the whole reply ("unknown" may be part of an answer).
ABSTENTION_REPLIES = frozenset(
    {"unknown", "not known", "no idea", "none", "unclear", "cannot say", "cant say"}
)


def clean_completion(text: str) -> str:
    """The reply itself: cut at the first end-of-turn token, other special tokens removed, stripped."""
    end = _END.search(text)
    if end is not None:
        text = text[: end.start()]
    return _SPECIAL.sub(" ", text).strip()


def strip_answer_prefix(text: str) -> str:
    """``"Answer: Mara Venn"`` -> ``"Mara Venn"`` (the format word is not part of the answer)."""
    return _ANSWER_PREFIX.sub("", text, count=1)


def exact_match(prediction: str, truth: str) -> bool:
    """SQuAD exact match after normalisation."""
    return normalize_answer(prediction) == normalize_answer(truth)


def f1_score(prediction: str, truth: str) -> float:
    """SQuAD token F1 between the normalised prediction and truth (1.0 when both are empty)."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def _declines(sentence: str) -> bool:
    """One SQuAD-normalised sentence says it cannot answer."""
    padded = f" {sentence} "
    return sentence in ABSTENTION_REPLIES or any(f" {phrase} " in padded for phrase in ABSTENTION_PHRASES)


def is_abstention(text: str) -> bool:
    """Whether a reply declines to answer ("I don't know.", "The context does not say.", "Unknown").

    Every sentence of the reply must decline: an answer plus a hedge ("Paris. I don't know.") is an
    answer, and on an unanswerable question a hallucination. Matching is on each SQuAD-normalised
    sentence, so case, punctuation, articles and a present or absent end-of-turn token do not
    matter. An empty reply is not an abstention: it says nothing.
    """
    reply = strip_answer_prefix(clean_completion(text))
    sentences = [normalize_answer(part) for part in _SENTENCE_END.split(reply)]
    sentences = [sentence for sentence in sentences if sentence]
    return bool(sentences) and all(_declines(sentence) for sentence in sentences)
