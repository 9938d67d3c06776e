"""The tokenizer's special tokens against the chat template and the model: what a mis-converted tokenizer
gets wrong before a single step is trained.

A converted tokenizer can be wrong in ways no tensor check sees: transformers' GGUF conversion of
SmolLM2 made the turn-start token ``<|im_start|>`` its eos (so its pad), and its eos disagreed with the
model's own ``generation_config``. Each problem below names the token, its id and the fix:

- **turn-start stop or pad**: the tokenizer's eos or pad token, or an extra stop token, is a special
  token the template writes where a conversation or a turn *begins* (Llama-3's ``<|begin_of_text|>``
  and ``<|start_header_id|>``, ChatML's ``<|im_start|>``): generation would stop where a turn starts,
  and every prompt holds it. The model's own ``generation_config`` eos ids are its authors' word and
  are not judged (Phi-3 lists ``<|assistant|>``).
- **doubled start**: the prompt ids the pipeline renders begin with the same special token twice
  (a template that writes bos and a tokenizer that prepends it again).
- **eos not the model's**: the tokenizer's eos is not among the model's ``generation_config`` eos ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from grpo.model.chat import SYSTEM_PROMPT, render_prompt, special_ids, template_end_of_turn_id

FIX = (
    "fix the tokenizer's special tokens in its tokenizer_config.json (eos_token: the end-of-turn token), or "
    "for a GGUF file give the .gguf itself as model.name_or_path: `grpo base` converts it and repairs the "
    "tokenizer from the file's metadata"
)


def _name(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return f"{tokenizer.convert_ids_to_tokens(int(token_id))!r} (id {int(token_id)})"


def turn_start_tokens(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any]) -> set[int]:
    """Special ids the chat template writes where a conversation or a turn begins: every special id of a
    rendered system + user prompt except the template's end-of-turn token."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}]
    prompt = render_prompt(tokenizer, messages, **template_kwargs)
    return set(prompt) & special_ids(tokenizer) - {template_end_of_turn_id(tokenizer)}


def generation_eos_ids(model: Any) -> list[int]:
    """The eos ids of the model's own ``generation_config`` (empty when it declares none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos or []]


def boundary_problems(
    tokenizer: PreTrainedTokenizerBase,
    model: Any,
    extra_stop_tokens: Sequence[str],
    template_kwargs: Mapping[str, Any],
) -> list[str]:
    """Every problem of the tokenizer's special tokens (see the module docstring); empty when none."""
    starts = turn_start_tokens(tokenizer, template_kwargs)
    eot = template_end_of_turn_id(tokenizer)
    problems = []
    roles = {"eos token": tokenizer.eos_token_id, "pad token": tokenizer.pad_token_id}
    roles |= {f"extra stop token {t!r}": tokenizer.convert_tokens_to_ids(t) for t in extra_stop_tokens}
    for role, token_id in roles.items():
        if token_id is not None and int(token_id) in starts:
            problems.append(
                f"the tokenizer's {role} {_name(tokenizer, token_id)} is a turn-start token of the chat template "
                f"(its end-of-turn token is {_name(tokenizer, eot)}): generation would stop where a turn begins; "
                + (
                    "set model.extra_stop_tokens without it"
                    if role.startswith("extra")
                    else "set model.pad_token to a token that is not a turn or header token"
                    if role == "pad token"
                    else FIX
                )
            )
    prompt = render_prompt(
        tokenizer,
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}],
        **template_kwargs,
    )
    if len(prompt) >= 2 and prompt[0] == prompt[1] and prompt[0] in special_ids(tokenizer):
        problems.append(
            f"the rendered prompt ids begin with {_name(tokenizer, prompt[0])} twice: the tokenizer "
            f"prepends it and the chat template writes it too; {FIX}"
        )
    declared = generation_eos_ids(model)
    if declared and tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in declared:
        problems.append(
            f"the tokenizer's eos token {_name(tokenizer, tokenizer.eos_token_id)} is not among the "
            f"model's generation_config eos ids {[_name(tokenizer, i) for i in declared]}: the two "
            f"disagree on where a reply ends; {FIX}"
        )
    return problems
