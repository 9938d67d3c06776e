"""The embedded default model: a byte-level BPE tokenizer trained on the project's own text, carrying the
Llama-3 special tokens and the Llama-3-Instruct chat template, and a small ``LlamaForCausalLM``.

Its pad token is ``<|eot_id|>``, exactly as many real Llama-3 fine-tuning setups do: pad == end-of-turn
is the normal case the masks must handle (I5), not one to avoid.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from grpo.config import TinyModelConfig
from grpo.model.chat import SYSTEM_PROMPT
from grpo.model.kernels import GROUPED_SDPA
from grpo.model.precision import fp32_head

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT]

# The Llama-3-Instruct template (Meta-Llama-3-8B-Instruct's tokenizer_config.json).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Always in the tokenizer's training text, so the words of the instructions are whole tokens.
BUILTIN_CORPUS = (
    SYSTEM_PROMPT,
    "If the context does not say, answer: I don't know.",
    "Context: Question: Options: Answer: A B C",
    "Answer with the letter of the right option, as 'Answer: A', 'Answer: B' or 'Answer: C'.",
    "The answer cannot be determined from the context. Not enough information. Unknown.",
)


def build_tiny_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it with the Llama-3 specials and template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [*BUILTIN_CORPUS, *texts]
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[EOS, START_HEADER, END_HEADER],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        # Llama takes no token_type_ids: standard tools (pipeline, TRL) hand the tokenizer's whole
        # output to generate(), which would reject them.
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, sizes: TinyModelConfig, seed: int
) -> LlamaForCausalLM:
    """A small Llama-architecture model sized by ``sizes``, initialised from ``seed``."""
    eos_ids = [tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOS)]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_hidden_layers,
        num_attention_heads=sizes.num_attention_heads,
        num_key_value_heads=sizes.num_key_value_heads,
        max_position_embeddings=sizes.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        attn_implementation=GROUPED_SDPA,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    return fp32_head(model)


def build_tiny(
    out_dir: str | Path, texts: Iterable[str], sizes: TinyModelConfig, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build the embedded default and save it (safetensors) to ``out_dir``."""
    tokenizer = build_tiny_tokenizer(texts, sizes.vocab_size)
    model = build_tiny_model(tokenizer, sizes, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, tokenizer
