"""The one renderer: chat messages and token ids for SFT, rollout, scoring and eval (I1, I2).

Every stage renders through ``render_prompt``; ``render_sft`` renders the whole conversation and
checks that it starts with exactly those prompt ids, so SFT and RL cannot drift apart. Only the
tokenizer's own chat template is used: a hand-joined "\\n\\n" prompt is the bug this module rules out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from grpo.errors import GrpoError

SYSTEM_PROMPT = "You are a careful assistant. Answer only from the context."
"""The system turn of every conversation the pipeline renders (``data/prompts.py``), the embedded
tokenizer learns (``tiny.py``) and a converted GGUF template falls back to (``gguf.py``)."""
# Used only to find the template's end-of-turn token; any plain text without special tokens works.
_SENTINEL = "Sentinel reply."
# Fixed so the Llama-3.2 template (which prints today's date) renders the same on any day.
_DETECT_KWARGS = {"date_string": "26 Jul 2024"}


class ChatError(GrpoError, ValueError):
    """A record cannot be rendered, or a tokenizer's template breaks the SFT/RL contract."""


class SftExample(NamedTuple):
    ids: list[int]  # [T] prompt + assistant content + end-of-turn
    loss_mask: list[bool]  # [T] True on the assistant content and its end-of-turn token only


# --------------------------------------------------------------------------- text -> ids


def _template_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def _apply(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    generation_prompt: bool,
    kwargs: Mapping[str, Any],
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False, **kwargs
    )
    return [int(i) for i in ids]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs: Any
) -> list[int]:
    """Prompt ids ending with the assistant header (the generation prompt), as every stage sees them.

    ``template_kwargs`` go to the chat template (e.g. ``date_string="26 Jul 2024"`` for Llama-3.2).
    """
    return _apply(tokenizer, messages, True, template_kwargs)


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every special id: the configured ones and the added tokens marked special (Phi-3's ``<|end|>``)."""
    added = {int(i) for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    return added | {int(i) for i in tokenizer.all_special_ids}


def _first_special_after(ids: list[int], start: int, specials: set[int]) -> int:
    """Index of the first special id at or after ``start``; -1 when none."""
    return next((i for i in range(start, len(ids)) if ids[i] in specials), -1)


def render_sft(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], target: str, **template_kwargs: Any
) -> SftExample:
    """The conversation plus the assistant ``target``, cut after the end-of-turn token (I1, I2).

    The first ``len(render_prompt(...))`` ids are checked to be exactly the RL prompt ids; the loss
    mask selects the assistant content and the end-of-turn token; anything the template adds after
    the end-of-turn (Qwen's "\\n", Phi-3's ``<|endoftext|>``) is dropped so the model learns to stop
    where generation stops.
    """
    prompt = render_prompt(tokenizer, messages, **template_kwargs)
    full = _apply(tokenizer, [*messages, {"role": "assistant", "content": target}], False, template_kwargs)
    if full[: len(prompt)] != prompt:
        raise ChatError(
            f"{_template_name(tokenizer)}: the chat template renders the SFT conversation with a prefix "
            "different from the generation prompt (SFT/RL template drift: the model would be trained on "
            "one format and sampled in another); fix the template so that add_generation_prompt=True "
            "yields exactly the start of the rendered assistant turn"
        )
    end = _first_special_after(full, len(prompt), special_ids(tokenizer))
    if end < 0:
        raise ChatError(
            f"{_template_name(tokenizer)}: no end-of-turn token after the assistant content {target!r}; "
            "the template must close the assistant turn with a special token so the model learns to stop"
        )
    ids = full[: end + 1]
    loss_mask = [False] * len(prompt) + [True] * (len(ids) - len(prompt))
    return SftExample(ids, loss_mask)


def template_end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The special token the chat template puts right after an assistant turn's content.

    Found by rendering a one-turn assistant conversation with a sentinel reply: Llama ``<|eot_id|>``,
    Qwen ``<|im_end|>``, Phi-3 ``<|end|>`` (which is not Phi-3's configured eos).
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}]
    ids = render_sft(tokenizer, messages, _SENTINEL, **_DETECT_KWARGS).ids
    return ids[-1]


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, extra_tokens: Iterable[str] = ()) -> list[int]:
    """Every id that ends a completion: eos, the template's end-of-turn, and ``extra_tokens``.

    De-duplicated, in that order. An unknown extra token is an error (it would silently never stop).
    """
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids.append(template_end_of_turn_id(tokenizer))
    vocab = tokenizer.get_vocab()
    for token in extra_tokens:
        if token not in vocab:
            raise ChatError(
                f"model.extra_stop_tokens: {token!r} is not a token of {_template_name(tokenizer)}; "
                "use the exact token text (e.g. '<|eom_id|>') or remove it"
            )
        ids.append(int(vocab[token]))
    return list(dict.fromkeys(ids))
