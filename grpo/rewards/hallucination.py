"""Hallucination reward: grounded QA where the right move on an unanswerable question is to abstain.

A record has ``context``, ``answer``, ``aliases`` (other accepted spellings) and ``answerable``.
A reply is correct when, after SQuAD normalisation, it equals the answer or an alias, or its token
F1 against one of them is at least ``F1_CORRECT``.

Reward table (the tests follow it row by row):

============  ===============  ======
question      reply            reward
============  ===============  ======
answerable    correct          +1.0
answerable    abstains         -0.5   (safe but unhelpful: better than inventing;
                                       params rewards.abstain_when_answered.hallucination)
answerable    wrong answer     -1.0
unanswerable  abstains         +1.0
unanswerable  any answer       -1.0   (a hallucination)
============  ===============  ======
"""

from __future__ import annotations

from typing import Any, NamedTuple

from grpo.errors import GrpoError
from grpo.rewards.text import clean_completion, exact_match, f1_score, is_abstention, strip_answer_prefix

F1_CORRECT = 0.8
REWARD_CORRECT = 1.0
REWARD_ABSTAIN_ANSWERABLE = -0.5
REWARD_WRONG = -1.0
REWARD_ABSTAIN_UNANSWERABLE = 1.0
REWARD_HALLUCINATED = -1.0


class HallucinationError(GrpoError, ValueError):
    """A hallucination record lacks a field the reward needs."""


class HallucinationOutcome(NamedTuple):
    """What one reply did on one grounded-QA record (reused by the evaluation)."""

    abstained: bool
    """The reply declines to answer (and is not itself a correct answer)."""
    correct: bool
    """Answerable: matches the answer (EM or F1 >= F1_CORRECT); unanswerable: abstained."""
    em: bool
    """Answerable: SQuAD exact match with the answer or an alias; unanswerable: abstained."""
    f1: float
    """Answerable: best SQuAD token F1 over answer and aliases; unanswerable: 1.0 if abstained else 0.0."""
    hallucinated: bool
    """The reply gives an answer that is not the right one."""


def _golds(example: dict[str, Any]) -> list[str]:
    golds = [example.get("answer") or "", *(example.get("aliases") or ())]
    return [gold for gold in golds if gold.strip()]


def hallucination_outcome(text: str, example: dict[str, Any]) -> HallucinationOutcome:
    """Score one reply against one record: abstention, correctness, EM, F1, hallucination."""
    if "answerable" not in example:
        raise HallucinationError(
            f"hallucination record {example.get('id', '?')!r} has no field 'answerable': records need "
            "context, answer, aliases, answerable (run `grpo prepare`)"
        )
    reply = strip_answer_prefix(clean_completion(text))
    if not example["answerable"]:
        abstained = is_abstention(reply)
        return HallucinationOutcome(abstained, abstained, abstained, float(abstained), not abstained)
    golds = _golds(example)
    if not golds:
        raise HallucinationError(
            f"answerable record {example.get('id', '?')!r} has an empty answer and no aliases: "
            "fix the record or mark it answerable: false"
        )
    em = any(exact_match(reply, gold) for gold in golds)
    f1 = max(f1_score(reply, gold) for gold in golds)
    correct = em or f1 >= F1_CORRECT
    # A correct reply is never an abstention, even if the answer itself is a word like "unknown".
    abstained = not correct and is_abstention(reply)
    return HallucinationOutcome(abstained, correct, em, f1, not correct and not abstained)


def hallucination_reward(
    text: str, example: dict[str, Any], abstain_when_answerable: float = REWARD_ABSTAIN_ANSWERABLE
) -> float:
    """Reward of one reply on one grounded-QA record; see the table in the module docstring.
    ``abstain_when_answerable``: the reward of an abstention on an answerable question."""
    outcome = hallucination_outcome(text, example)
    if example["answerable"]:
        if outcome.correct:
            return REWARD_CORRECT
        return abstain_when_answerable if outcome.abstained else REWARD_WRONG
    return REWARD_ABSTAIN_UNANSWERABLE if outcome.abstained else REWARD_HALLUCINATED
