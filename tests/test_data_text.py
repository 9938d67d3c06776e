"""grpo/data/text.py: whole-word containment, BBQ unknown phrasings, normalised text keys."""

from __future__ import annotations

import pytest

from grpo.data.schema import UNKNOWN_PHRASES
from grpo.data.text import contains, is_unknown_phrase, text_key


@pytest.mark.parametrize(
    ("text", "span", "expected"),
    [
        ("Elbrook lies on the Ostra River.", "Ostra", True),
        ("Elbrook lies on the Ostra River.", "the ostra river", True),  # articles and case ignored
        ("They threw a party.", "art", False),  # whole words only
        ("Founded in 1821.", "1821", True),
        ("Founded in 1821.", "", False),
    ],
)
def test_contains(text, span, expected):
    assert contains(text, span) is expected


def test_every_unknown_phrasing_is_recognised_and_people_are_not():
    assert all(is_unknown_phrase(p) for p in UNKNOWN_PHRASES)
    assert is_unknown_phrase("can't be determined.") and is_unknown_phrase("CANNOT ANSWER")
    assert not is_unknown_phrase("The Velorian nurse")
    assert not is_unknown_phrase("The man not known to the others")  # a phrase inside an option is no unknown
    assert not is_unknown_phrase("Unknown to me, the nurse")


def test_text_key_ignores_case_and_punctuation_but_not_words():
    assert text_key("A met B.", "Who left?") == text_key("a met b", "who left")
    assert text_key("A met B.", "Who left?") != text_key("A met C.", "Who left?")
