"""Monitor: the chat-boundary checks of the first steps (a broken template, a second end-of-turn token, an
echoed prompt, the boundary metric rules), on hand-made completions and on the stage's own path."""

from __future__ import annotations

import logging

import pytest

from grpo.config import MonitorConfig
from grpo.health.monitor import Monitor, MonitorError, TrainingStopped, raise_if_stop
from grpo.model.chat import end_of_turn_ids
from grpo.train.step import StepResult
from grpo.train.trainer import watch
from tests.conftest import real_tokenizer_path
from tests.steps import STAGE_CONTEXT, stage_result

USER = f"{STAGE_CONTEXT}\nQuestion: Who was late? Options: A. the tall one B. the short one C. Unknown"
EOT = "<|eot_id|>"


# --------------------------------------------------------------------------- boundary


@pytest.fixture
def boundary(tiny_tokenizer):
    """The tiny tokenizer's rendered prompt, its header tokens and its end-of-turn token."""
    messages = [{"role": "user", "content": USER}]
    prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    decoded = tiny_tokenizer.decode(tiny_tokenizer(prompt, add_special_tokens=False).input_ids, skip_special_tokens=True)
    headers = [t for t in tiny_tokenizer.all_special_tokens if t not in (EOT, tiny_tokenizer.eos_token)]
    assert "<|start_header_id|>" in headers
    return decoded, headers, [EOT]


def test_broken_template_is_stopped_at_step_zero(boundary):
    prompt, headers, eots = boundary
    completions = ["<|start_header_id|>assistant<|end_header_id|>\n\nAnswer: A" + EOT, "Answer: C" + EOT]
    findings = Monitor(MonitorConfig()).check_boundary(0, completions, [prompt] * 2, headers, eots)
    assert [(f.rule, f.action, f.step) for f in findings] == [("boundary_header", "stop", 0)]
    with pytest.raises(TrainingStopped, match="boundary_header") as stop:
        raise_if_stop(findings)
    assert "I1" in str(stop.value) and "start_header_id" in str(stop.value)


def test_two_end_of_turn_tokens_are_stopped(boundary):
    prompt, headers, eots = boundary
    findings = Monitor(MonitorConfig()).check_boundary(1, ["Answer: A" + EOT + EOT], [prompt], headers, eots)
    assert [(f.rule, f.action) for f in findings] == [("boundary_end_of_turn", "stop")]


@pytest.mark.parametrize(
    ("completion", "echo"),
    [
        ("Answer: A" + EOT, False),
        ("a tall one and a short one, met at the station." + EOT, False),  # extractive, mid-context
        (None, True),  # the prompt's tail leaked before the answer (cut at the wrong width, I4)
        ("user\n\n" + USER[:40] + EOT, True),  # the prompt regurgitated from its start
    ],
)
def test_prompt_echo(boundary, completion, echo):
    prompt, headers, eots = boundary
    completion = completion if completion is not None else prompt[-30:] + "Answer: A" + EOT
    findings = Monitor(MonitorConfig()).check_boundary(1, [completion], [prompt], headers, eots)
    assert [f.rule for f in findings] == (["boundary_prompt_echo"] if echo else [])


def test_an_echo_of_exactly_the_width_counts_and_one_char_short_does_not(boundary):
    """The rule's threshold (20 chars) is the shortest echo it names: a completion of exactly the prompt's
    first 20 chars, or exactly its last 20, is an echo; 19 of them are not (so "20 chars or more" holds at
    both ends of the prompt, and of a prompt no longer than it)."""
    _, headers, eots = boundary
    width = int(MonitorConfig().boundary_prompt_echo.threshold)
    prompt = "abcdefghijklmnopqrstuvwxyz0123456789"  # no spaces: each cut is exactly its chars
    for text, echo in ((prompt[:width], True), (prompt[-width:], True), (prompt[:width - 1], False),
                       (prompt[-(width - 1):], False)):
        findings = Monitor(MonitorConfig()).check_boundary(1, [text], [prompt], headers, eots)
        assert [f.rule for f in findings] == (["boundary_prompt_echo"] if echo else []), (text, echo)
    short = prompt[:width]  # a prompt of exactly the width, echoed whole
    findings = Monitor(MonitorConfig()).check_boundary(1, [short + "!"], [short], headers, eots)
    assert [f.rule for f in findings] == ["boundary_prompt_echo"]


def test_healthy_completions_pass_the_boundary(boundary):
    prompt, headers, eots = boundary
    completions = ["Answer: A" + EOT, "Answer: C." + EOT, "I don't know." + EOT, "Answer: B"]
    monitor = Monitor(MonitorConfig())
    for step in (1, 2, 3):
        assert monitor.check_boundary(step, completions, [prompt] * 4, headers, eots) == []


def test_boundary_is_checked_only_on_the_first_steps(boundary):
    prompt, headers, eots = boundary
    broken = ["<|start_header_id|>assistant<|end_header_id|>\n\nAnswer: A"]
    monitor = Monitor(MonitorConfig(boundary_steps=3))
    assert monitor.check_boundary(4, broken, [prompt], headers, eots) == []
    assert monitor.observe(4, {"entropy": 0.001, "completions/clipped_ratio": 1.0}) == []


def test_boundary_metric_rules(caplog):
    monitor = Monitor(MonitorConfig())
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        findings = monitor.observe(1, {"entropy": 0.001, "completions/mean_length": 24.0, "completions/clipped_ratio": 1.0})
    assert sorted((f.rule, f.action) for f in findings) == [("boundary_clipped", "warn"), ("boundary_entropy_low", "stop")]
    assert any("boundary_clipped" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    empty = {"completions/mean_length": 1.0, "completions/clipped_ratio": 0.0}  # every answer only its stop token
    assert [f.rule for f in Monitor(MonitorConfig()).observe(1, empty)] == ["boundary_empty"]
    clipped = {"completions/mean_length": 1.0, "completions/clipped_ratio": 1.0}  # one token each, no stop token
    assert [f.rule for f in Monitor(MonitorConfig()).observe(1, clipped)] == ["boundary_clipped"]
    assert [f.rule for f in Monitor(MonitorConfig()).observe(2, {"entropy": 7.5})] == ["boundary_entropy_high"]


def test_check_boundary_needs_one_prompt_per_completion():
    with pytest.raises(MonitorError, match="2 completions and 1 prompts"):
        Monitor(MonitorConfig()).check_boundary(1, ["a", "b"], ["p"], [], [])


# --------------------------------------------------------------------------- the stage's own path


def watched(result: StepResult, step: int = 1) -> list[str]:
    """The rules that stop the trainer's ``watch`` on this step (none: [])."""
    try:
        watch(Monitor(MonitorConfig()), step, result)
    except TrainingStopped as stop:
        return [f.rule for f in stop.findings]
    return []


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("answers", "empty"),
    [
        (["", "", "", ""], True),  # every completion only its stop token: mean_length 1.0, content 0
        (["", "", "", "A"], True),  # mostly empty: under one token of content on average
        (["Answer: A", "", "Answer: C", ""], False),
        (["Answer: A", "Answer: B", "I don't know.", "Answer: C"], False),
    ],
)
def test_empty_completions_stop_on_the_stage_path(tiny_tokenizer, answers, empty):
    """The stage counts the stop token in every length, so all-empty answers read mean_length 1.0:
    the rule must still fire from the stage's own metrics."""
    eot = tiny_tokenizer.convert_tokens_to_ids(EOT)
    result = stage_result(tiny_tokenizer, [eot], [text_ids(tiny_tokenizer, a) + [eot] for a in answers])
    if all(not a for a in answers):
        assert result.metrics["completions/mean_length"] == 1.0
    assert watched(result) == (["boundary_empty"] if empty else [])


@pytest.mark.parametrize(("tokenizer_name", "end_token"),
                         [("tiny", "<|end_of_text|>"),
                          pytest.param("llama-3.2-instruct", "<|eom_id|>", marks=pytest.mark.needs_shared)])
def test_writing_on_after_an_end_token_stops_on_the_stage_path(tiny_tokenizer, tokenizer_name, end_token):
    """Stop ids of the template alone (a checkpoint whose generation config lists only <|eot_id|>): a
    completion that ends a turn with another end token and writes a second answer is cut only at
    <|eot_id|>. One such completion in four stops the run (the header rule needs more than a quarter)."""
    if tokenizer_name == "tiny":
        tokenizer = tiny_tokenizer
    else:
        from grpo.config import ModelConfig
        from grpo.model.loading import load_tokenizer

        tokenizer = load_tokenizer(real_tokenizer_path(tokenizer_name), ModelConfig())
    eos_ids = end_of_turn_ids(tokenizer)
    eot, end = tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(end_token)
    assert eos_ids == [eot] and end != tokenizer.unk_token_id
    healthy = [text_ids(tokenizer, a) + [eot] for a in ("Answer: A", "Answer: C", "I don't know.")]
    on_after = text_ids(tokenizer, "Answer: A") + [end] + text_ids(tokenizer, "Answer: B") + [eot]
    result = stage_result(tokenizer, eos_ids, [*healthy, on_after])
    assert result.raw_texts[-1] == f"Answer: A{end_token}Answer: B{EOT}"
    assert watched(result) == ["boundary_end_of_turn"]
    assert watched(stage_result(tokenizer, eos_ids, [*healthy, healthy[0]])) == []
    # With the end token among the stop ids the completion is cut there: nothing wrote on.
    assert watched(stage_result(tokenizer, [eot, end], [*healthy, on_after])) == []




def test_an_answer_that_quotes_the_end_of_the_question_later_on_is_no_echo():
    """The trainer passes each completion's user message. A reply that opens with its own words and then
    quotes the question's last words is an answer, not the prompt's tail leaked before it (I4)."""
    quoting = "Answer: C. Of the options (" + USER[-25:] + ") only the last fits." + EOT
    leaked = USER[-25:] + " Answer: C" + EOT
    monitor = Monitor(MonitorConfig())
    assert monitor.check_boundary(1, [quoting], [USER], [], [EOT]) == []
    assert [f.rule for f in monitor.check_boundary(1, [leaked], [USER], [], [EOT])] == ["boundary_prompt_echo"]
