"""grpo/model/chat.py: one renderer for SFT and RL (I1), targets that end the turn (I2), stop tokens."""

from __future__ import annotations

import copy
import datetime
import functools
import re

import pytest

from grpo.config import ModelConfig
from grpo.data import prompts
from grpo.data.schema import ABSTENTION
from grpo.errors import GrpoError
from grpo.model import chat
from grpo.model.loading import load_tokenizer
from grpo.model.tiny import LLAMA3_CHAT_TEMPLATE
from tests.conftest import REAL_TOKENIZER_PARAMS, real_tokenizer_path

DATE = {"date_string": "26 Jul 2024"}

FAIRNESS = {
    "id": "f1",
    "task": "fairness",
    "context": "Two friends, a tall one and a short one, met at the station.",
    "question": "Who was late?",
    "choices": ["the tall one", "the short one", "Unknown"],
    "label": 2,
}
ANSWERABLE = {
    "id": "h1",
    "task": "hallucination",
    "context": "The river town of Elbrook was founded by Mara Venn in 1821.",
    "question": "Who founded Elbrook?",
    "answer": "Mara Venn",
}
UNANSWERABLE = {**ANSWERABLE, "id": "h2", "question": "Who is the mayor of Elbrook?", "answer": ABSTENTION}
RECORDS = (FAIRNESS, ANSWERABLE, UNANSWERABLE)


@functools.cache
def _load(name: str):
    """Each real tokenizer once per session (tests here never mutate one; they copy it first)."""
    return load_tokenizer(real_tokenizer_path(name), ModelConfig())


@pytest.fixture(scope="module", params=("tiny",) + REAL_TOKENIZER_PARAMS)
def tok(request, tiny_tokenizer):
    """The tiny tokenizer and each real one, loaded once per module (skips when absent)."""
    return tiny_tokenizer if request.param == "tiny" else _load(request.param)


# --------------------------------------------------------------------------- records -> messages


def test_fairness_messages_letter_the_options_and_ask_for_answer_letter():
    system, user = prompts.example_messages(FAIRNESS)
    assert system["role"] == "system" and user["role"] == "user"
    text = user["content"]
    for part in (
        FAIRNESS["context"],
        FAIRNESS["question"],
        "A. the tall one",
        "B. the short one",
        "C. Unknown",
    ):
        assert part in text
    assert "Answer: A" in text


def test_hallucination_messages_ask_to_abstain_exactly():
    _, user = prompts.example_messages(ANSWERABLE)
    assert ANSWERABLE["context"] in user["content"] and ANSWERABLE["question"] in user["content"]
    assert ABSTENTION in user["content"] and "only from the context" in user["content"]


@pytest.mark.parametrize(
    "record, field",
    [({**FAIRNESS, "task": "poetry"}, "task"), ({**FAIRNESS, "choices": ["a", "b"]}, "choices")],
)
def test_bad_record_raises_error_naming_field_and_record(record, field):
    with pytest.raises(GrpoError, match=field) as info:
        prompts.example_messages(record)
    assert "'f1'" in str(info.value)


def test_sft_target_prefers_noised_supervision():
    assert prompts.sft_target(FAIRNESS) == "Answer: C"
    assert prompts.sft_target({**FAIRNESS, "sft_label": 0}) == "Answer: A"
    assert prompts.sft_target({**FAIRNESS, "label": "B"}) == "Answer: B"
    assert prompts.sft_target(ANSWERABLE) == "Mara Venn"
    assert prompts.sft_target({**ANSWERABLE, "sft_answer": ABSTENTION}) == ABSTENTION
    assert prompts.sft_target(UNANSWERABLE) == ABSTENTION
    with pytest.raises(GrpoError, match="label"):
        prompts.sft_target({**FAIRNESS, "label": 7})
    with pytest.raises(GrpoError, match="got True"):  # a bool is no option index (True would read as B)
        prompts.sft_target({**FAIRNESS, "label": True})


def test_a_text_answer_record_asks_for_and_teaches_the_options_words():
    """``answer_format: text``: the prompt asks for the option's words, SFT teaches them (noised label
    included), and the fairness reward reads the taught reply as that option."""
    from grpo.rewards.fairness import parse_choice

    by_text = {**FAIRNESS, "answer_format": "text"}
    user = prompts.example_messages(by_text)[-1]["content"]
    assert user.endswith(prompts.FAIRNESS_TEXT_INSTRUCTION) and prompts.FAIRNESS_INSTRUCTION not in user
    assert prompts.sft_target(by_text) == "Answer: Unknown"
    assert prompts.sft_target({**by_text, "sft_label": 0}) == "Answer: the tall one"
    assert parse_choice(prompts.sft_target({**by_text, "sft_label": 1}), by_text["choices"]) == 1
    assert prompts.example_messages({**FAIRNESS, "answer_format": "letter"}) == prompts.example_messages(FAIRNESS)


# --------------------------------------------------------------------------- I1


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["id"])
def test_i1_sft_prompt_ids_equal_rl_prompt_ids(tok, record):
    messages = prompts.example_messages(record)
    prompt = chat.render_prompt(tok, messages, **DATE)
    sft = chat.render_sft(tok, messages, prompts.sft_target(record), **DATE)
    assert sft.ids[: len(prompt)] == prompt
    assert sft.loss_mask[: len(prompt)] == [False] * len(prompt)
    assert len(sft.ids) > len(prompt)


def _naive_sft_prompt_ids(tokenizer, messages) -> list[int]:
    """The known bug: SFT prompts hand-joined with blank lines instead of the chat template."""
    text = "\n\n".join(message["content"] for message in messages) + "\n\n"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def test_i1_naive_joined_sft_prompt_would_fail_the_check(tok):
    messages = prompts.example_messages(FAIRNESS)
    prompt = chat.render_prompt(tok, messages, **DATE)
    naive = _naive_sft_prompt_ids(tok, messages)
    assert naive[: len(prompt)] != prompt


def test_every_stage_renders_prompts_with_the_configured_template_variables(tiny_tokenizer):
    """``render_records`` (the rollout's and evaluation's prompts) hands ``model.chat_template_kwargs`` to the
    template as SFT's ``render_sft`` does (I1): a template that prints a date (Llama-3.2's) renders the
    configured one, never today's."""
    dated = copy.deepcopy(tiny_tokenizer)
    dated.chat_template = "{{ date_string | default('today') }}|" + LLAMA3_CHAT_TEMPLATE
    kwargs = {"date_string": "26 Jul 2024"}
    ids = prompts.render_records(dated, [FAIRNESS], kwargs)[0]
    assert ids == chat.render_prompt(dated, prompts.example_messages(FAIRNESS), **kwargs)
    assert ids != chat.render_prompt(dated, prompts.example_messages(FAIRNESS))
    sft = chat.render_sft(dated, prompts.example_messages(FAIRNESS), prompts.sft_target(FAIRNESS), **kwargs)
    assert sft.ids[: len(ids)] == ids


def test_i1_template_drift_raises_error_naming_tokenizer(tiny_tokenizer):
    drifted = copy.deepcopy(tiny_tokenizer)
    # The generation prompt opens a "model" turn while trained turns are rendered as "assistant".
    drifted.chat_template = LLAMA3_CHAT_TEMPLATE.replace(
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}",
        "{{ '<|start_header_id|>model<|end_header_id|>\n\n' }}",
    )
    assert drifted.chat_template != LLAMA3_CHAT_TEMPLATE
    messages = prompts.example_messages(FAIRNESS)
    with pytest.raises(GrpoError, match="drift"):
        chat.render_sft(drifted, messages, "Answer: C")


def test_i1_template_drift_in_the_prompts_last_token_alone_raises(tiny_tokenizer):
    """The generation prompt ends its header with a newline and a space where the trained turns have two
    newlines: the prompts are one id apart, at the end."""
    drifted = copy.deepcopy(tiny_tokenizer)
    drifted.chat_template = LLAMA3_CHAT_TEMPLATE.replace(
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}",
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n ' }}",
    )
    messages = prompts.example_messages(FAIRNESS)
    prompt, right = chat.render_prompt(drifted, messages), chat.render_prompt(tiny_tokenizer, messages)
    assert len(prompt) == len(right) and prompt[:-1] == right[:-1] and prompt[-1] != right[-1]
    with pytest.raises(GrpoError, match="drift"):
        chat.render_sft(drifted, messages, "Answer: C")


# --------------------------------------------------------------------------- I2


def test_i2_a_template_that_never_closes_the_assistant_turn_raises(tiny_tokenizer):
    """Turns closed by a newline instead of a special token: nothing after the assistant content could end a
    completion, so the SFT example is refused (it would teach a model that never stops), whatever the ids."""
    unclosed = copy.deepcopy(tiny_tokenizer)
    unclosed.chat_template = LLAMA3_CHAT_TEMPLATE.replace("'<|eot_id|>'", "'\\n'")
    assert unclosed.chat_template != LLAMA3_CHAT_TEMPLATE
    with pytest.raises(GrpoError, match="no end-of-turn token after the assistant content"):
        chat.render_sft(unclosed, prompts.example_messages(FAIRNESS), "Answer: C")


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["id"])
def test_i2_sft_target_ends_with_end_of_turn_and_only_assistant_tokens_carry_loss(tok, record):
    messages = prompts.example_messages(record)
    target = prompts.sft_target(record)
    prompt = chat.render_prompt(tok, messages, **DATE)
    sft = chat.render_sft(tok, messages, target, **DATE)
    end_of_turn = chat.template_end_of_turn_id(tok)
    supervised = [i for i, keep in zip(sft.ids, sft.loss_mask, strict=True) if keep]
    assert len(sft.ids) == len(sft.loss_mask)
    assert sft.ids[-1] == end_of_turn and supervised[-1] == end_of_turn
    assert sft.loss_mask == [False] * len(prompt) + [True] * (len(sft.ids) - len(prompt))
    assert tok.decode(supervised) == target + tok.convert_ids_to_tokens(end_of_turn)
    assert end_of_turn not in supervised[:-1]


# --------------------------------------------------------------------------- stop tokens

EXPECTED_STOPS = {
    "llama-3.2-instruct": ["<|eot_id|>"],
    "qwen2.5-0.5b-instruct": ["<|im_end|>"],
    "phi-3-mini-4k-instruct": ["<|endoftext|>", "<|end|>"],
}


def test_end_of_turn_ids_of_tiny_tokenizer_is_eot(tiny_tokenizer):
    assert tiny_tokenizer.convert_ids_to_tokens(chat.end_of_turn_ids(tiny_tokenizer)) == ["<|eot_id|>"]


@pytest.mark.parametrize("name", REAL_TOKENIZER_PARAMS)
def test_end_of_turn_ids_detects_each_template_token(name):
    tokenizer = _load(name)
    assert tokenizer.convert_ids_to_tokens(chat.end_of_turn_ids(tokenizer)) == EXPECTED_STOPS[name]


def test_phi3_end_of_turn_is_a_stop_token_though_not_its_eos():
    tokenizer = _load("phi-3-mini-4k-instruct")
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert tokenizer.eos_token_id != end
    assert chat.template_end_of_turn_id(tokenizer) == end
    assert end in chat.end_of_turn_ids(tokenizer)
    sft = chat.render_sft(tokenizer, prompts.example_messages(FAIRNESS), "Answer: C")
    assert sft.ids[-1] == end and tokenizer.eos_token_id not in sft.ids


def test_qwen_pad_differs_from_eos_and_sft_ids_stop_at_im_end():
    tokenizer = _load("qwen2.5-0.5b-instruct")
    stops = chat.end_of_turn_ids(tokenizer)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.pad_token_id not in stops
    sft = chat.render_sft(tokenizer, prompts.example_messages(ANSWERABLE), "Mara Venn")
    # The template writes "\n" after <|im_end|>; generation stops before it, so SFT must too.
    assert tokenizer.convert_ids_to_tokens(sft.ids[-1]) == "<|im_end|>"


@pytest.mark.needs_shared
def test_llama32_date_string_makes_rendering_reproducible():
    tokenizer = _load("llama-3.2-instruct")
    messages = prompts.example_messages(FAIRNESS)
    first = chat.render_prompt(tokenizer, messages, **DATE)
    assert first == chat.render_prompt(tokenizer, messages, **DATE)
    assert "Today Date: 26 Jul 2024" in tokenizer.decode(first)
    assert chat.render_sft(tokenizer, messages, "Answer: C", **DATE).ids[: len(first)] == first
    today = datetime.date.today().strftime("%d %b %Y")
    if today != DATE["date_string"]:
        assert chat.render_prompt(tokenizer, messages) != first


def test_extra_stop_tokens_are_added_once_and_unknown_ones_raise(tiny_tokenizer):
    ids = chat.end_of_turn_ids(tiny_tokenizer, extra_tokens=("<|end_of_text|>", "<|eot_id|>"))
    assert tiny_tokenizer.convert_ids_to_tokens(ids) == ["<|eot_id|>", "<|end_of_text|>"]
    with pytest.raises(GrpoError, match=re.escape("<|nope|>")):
        chat.end_of_turn_ids(tiny_tokenizer, extra_tokens=("<|nope|>",))


def test_an_empty_target_supervises_the_end_of_turn_alone(tok):
    """An empty reply renders as the prompt then the end-of-turn token, the one supervised id (I2)."""
    messages = prompts.example_messages(ANSWERABLE)
    prompt = chat.render_prompt(tok, messages, **DATE)
    sft = chat.render_sft(tok, messages, "", **DATE)
    assert sft.ids == [*prompt, chat.template_end_of_turn_id(tok)]
    assert sft.loss_mask == [False] * len(prompt) + [True]
