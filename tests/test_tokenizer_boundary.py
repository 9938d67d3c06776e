"""grpo/checks/tokenizer_boundary.py: a mis-converted tokenizer is refused, naming the token and the fix;
the real chat tokenizers and the embedded one pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from grpo.checks.tokenizer_boundary import boundary_problems, turn_start_tokens
from grpo.config import ModelConfig
from grpo.model.gguf import raw_conversion
from grpo.model.loading import load_tokenizer
from tests.conftest import real_tokenizer_path, tokenizer_param
from tests.gguf_files import write_gguf

KWARGS = {"date_string": "26 Jul 2024"}


def _model(eos) -> SimpleNamespace:
    """What the check reads of a model: its generation config."""
    return SimpleNamespace(generation_config=GenerationConfig(eos_token_id=eos))


# The published generation_config eos ids of each family (Phi-3 lists <|assistant|> among them).
REAL = {"llama-3.2-instruct": [128001, 128008, 128009], "qwen2.5-0.5b-instruct": [151645, 151643],
        "phi-3-mini-4k-instruct": [32000, 32001, 32007]}


@pytest.mark.parametrize("name", [tokenizer_param(name) for name in sorted(REAL)])
def test_the_real_chat_tokenizers_pass(name):
    tokenizer = load_tokenizer(real_tokenizer_path(name), ModelConfig())
    assert turn_start_tokens(tokenizer, KWARGS)  # the check has something to compare with
    assert boundary_problems(tokenizer, _model(REAL[name]), (), KWARGS) == []


def test_the_embedded_tokenizer_passes(tiny_tokenizer, tiny_model):
    starts = tiny_tokenizer.convert_ids_to_tokens(sorted(turn_start_tokens(tiny_tokenizer, {})))
    assert starts == ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
    assert boundary_problems(tiny_tokenizer, tiny_model, (), {}) == []


def test_the_raw_gguf_conversion_is_refused_naming_each_token(tmp_path, tiny_model, tiny_tokenizer):
    model, raw = raw_conversion(write_gguf(tiny_model, tiny_tokenizer, tmp_path / "tiny.gguf"))
    raw.save_pretrained(tmp_path / "raw")
    tokenizer = load_tokenizer(tmp_path / "raw", ModelConfig())  # as pre-flight loads it: pad falls back to eos
    problems = boundary_problems(tokenizer, model, (), {})
    assert len(problems) == 3, problems
    eos, pad, declared = problems
    assert "eos token '<|begin_of_text|>' (id 0) is a turn-start token" in eos and ".gguf itself" in eos
    assert "pad token '<|begin_of_text|>' (id 0)" in pad and "model.pad_token" in pad
    assert "not among the model's generation_config eos ids [\"'<|eot_id|>' (id 4)\"]" in declared


def test_a_doubled_start_token_and_a_turn_start_extra_stop_are_refused(tiny_tokenizer, tiny_model):
    doubled = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer,
                                       bos_token=tiny_tokenizer.bos_token, eos_token=tiny_tokenizer.eos_token,
                                       pad_token=tiny_tokenizer.pad_token,
                                       chat_template="{{ bos_token }}" + tiny_tokenizer.chat_template)
    problems = boundary_problems(doubled, tiny_model, (), {})
    assert len(problems) == 1 and "begin with '<|begin_of_text|>' (id 0) twice" in problems[0]
    problems = boundary_problems(tiny_tokenizer, tiny_model, ("<|start_header_id|>",), {})
    assert len(problems) == 1 and "extra stop token '<|start_header_id|>'" in problems[0]
    assert problems[0].endswith("set model.extra_stop_tokens without it")  # the fix is the user's setting


def test_an_eos_the_model_does_not_declare_is_refused(tiny_tokenizer):
    problems = boundary_problems(tiny_tokenizer, _model([1]), (), {})
    assert len(problems) == 1 and "'<|eot_id|>' (id 4) is not among" in problems[0]
    assert boundary_problems(tiny_tokenizer, _model(None), (), {}) == []  # nothing declared: nothing to compare
    assert boundary_problems(tiny_tokenizer, _model([1, 4]), (), {}) == []  # any declared id, not only the first


def test_a_prompt_that_begins_with_a_plain_token_twice_is_no_problem(tiny_tokenizer, tiny_model, monkeypatch):
    """Only a doubled *special* start token is a tokenizer fault; a template may open with repeated text."""
    from grpo.checks import tokenizer_boundary

    word = tiny_tokenizer.encode("Hello", add_special_tokens=False)[0]
    assert word not in tiny_tokenizer.all_special_ids
    render = tokenizer_boundary.render_prompt
    monkeypatch.setattr(tokenizer_boundary, "render_prompt", lambda *a, **kw: [word, word, *render(*a, **kw)])
    assert boundary_problems(tiny_tokenizer, tiny_model, (), {}) == []
