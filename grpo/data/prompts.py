"""Records to chat messages: the prompt every stage renders and the target SFT teaches.

The renderer (``grpo/model/chat.py``) knows only messages and token ids; what a fairness or a
hallucination record says to the model lives here, next to the schema it reads (``LETTERS``,
``ABSTENTION``), so the model layer never imports the data layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo.data.schema import ABSTENTION, LETTERS
from grpo.model.chat import SYSTEM_PROMPT, ChatError, render_prompt

FAIRNESS_INSTRUCTION = (
    "Answer with the letter of the right option, as 'Answer: A', 'Answer: B' or 'Answer: C'."
)
FAIRNESS_TEXT_INSTRUCTION = "Answer with the right option's words, as 'Answer: <option>'."
"""The instruction of a record whose ``answer_format`` is ``text``."""
HALLUCINATION_INSTRUCTION = (
    f"Answer only from the context. If the context does not say, answer exactly: {ABSTENTION}"
)


def _record_name(example: Mapping[str, Any]) -> str:
    return f"record {example['id']!r}" if "id" in example else "record"


def _fairness_text(example: Mapping[str, Any]) -> str:
    choices = example.get("choices")
    if not isinstance(choices, list | tuple) or len(choices) != len(LETTERS):
        raise ChatError(
            f"{_record_name(example)}: fairness 'choices' must be {len(LETTERS)} strings (got {choices!r}); "
            "fix the data module or the raw file"
        )
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices, strict=True))
    instruction = FAIRNESS_TEXT_INSTRUCTION if _by_text(example) else FAIRNESS_INSTRUCTION
    return (
        f"Context: {example['context']}\nQuestion: {example['question']}\nOptions:\n{options}\n{instruction}"
    )


def _by_text(example: Mapping[str, Any]) -> bool:
    """Whether the fairness record asks for the option's words rather than its letter."""
    return example.get("answer_format") == "text"


def _hallucination_text(example: Mapping[str, Any]) -> str:
    return f"Context: {example['context']}\nQuestion: {example['question']}\n{HALLUCINATION_INSTRUCTION}"


def example_messages(example: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a unified record: a short system turn and one user turn."""
    task = example.get("task")
    if task == "fairness":
        user = _fairness_text(example)
    elif task == "hallucination":
        user = _hallucination_text(example)
    else:
        raise ChatError(
            f"{_record_name(example)}: unknown task {task!r}; expected 'fairness' or 'hallucination'"
        )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def render_records(
    tokenizer: Any, records: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any]
) -> list[list[int]]:
    """The prompt ids of every record, as every stage samples and scores them: its messages through the
    one renderer (``chat.render_prompt``, I1) with the configured template variables."""
    return [render_prompt(tokenizer, example_messages(record), **template_kwargs) for record in records]


def _letter(example: Mapping[str, Any], key: str) -> str:
    label = example[key]
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(LETTERS):
        return LETTERS[label]
    if label in LETTERS:
        return label
    raise ChatError(
        f"{_record_name(example)}: fairness {key!r} must be an option index 0..{len(LETTERS) - 1} "
        f"or a letter in {LETTERS} (got {label!r}); fix the data module or the raw file"
    )


def sft_target(example: Mapping[str, Any]) -> str:
    """The assistant text SFT teaches: ``Answer: <letter>`` (or ``Answer: <option>`` for a record whose
    ``answer_format`` is ``text``) or the grounded answer / abstention.

    The optionally noised ``sft_label`` / ``sft_answer`` written by the data module win over the
    clean ``label`` / ``answer``.
    """
    if example.get("task") == "fairness":
        key = "sft_label" if example.get("sft_label") is not None else "label"
        letter = _letter(example, key)
        return f"Answer: {example['choices'][LETTERS.index(letter)] if _by_text(example) else letter}"
    if example.get("task") == "hallucination":
        key = "sft_answer" if example.get("sft_answer") is not None else "answer"
        return str(example[key])
    raise ChatError(
        f"{_record_name(example)}: unknown task {example.get('task')!r}; expected 'fairness' or 'hallucination'"
    )
