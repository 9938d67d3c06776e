"""Models and tokenizers: the embedded tiny default, real models by path or hub id, LoRA wrapping.

The embedded default is a byte-level BPE tokenizer trained on the project's own text, carrying the
Llama-3 special tokens and the Llama-3-Instruct chat template, plus a small ``LlamaForCausalLM``. Its
pad token is ``<|eot_id|>``, exactly as many real Llama-3 fine-tuning setups do: pad == end-of-turn
is the normal case the masks must handle (I5), not one to avoid.

Real models go through the same ``load_model``/``load_tokenizer`` functions; nothing is downloaded
(the hub is used only as a local cache) and ``trust_remote_code`` stays off unless params turn it on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from grpo.config import LoraConfig, ModelConfig, TinyModelConfig
from grpo.errors import GrpoError
from grpo.files import write_json
from grpo.model.chat import SYSTEM_PROMPT
from grpo.model.kernels import GROUPED_SDPA, attention_kernel
from grpo.model.precision import fp32_head
from grpo.offline import model_source_problem

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

POINTER_FILE = "grpo_base.json"


class ModelLoadError(GrpoError, OSError):
    """A model or tokenizer could not be loaded; the message names the path and the fix."""


# --------------------------------------------------------------------------- embedded tiny model


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


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, sizes: TinyModelConfig, seed: int) -> LlamaForCausalLM:
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


# --------------------------------------------------------------------------- loading


def write_pointer(out_dir: str | Path, name_or_path: str) -> None:
    """Record that ``out_dir`` stands for an external model (no multi-GB copy of the weights)."""
    write_json(Path(out_dir) / POINTER_FILE, {"name_or_path": name_or_path})


def resolve(name_or_path: str | Path) -> str:
    """Follow a base pointer file; otherwise return the path or hub id unchanged."""
    pointer = Path(name_or_path) / POINTER_FILE
    if pointer.is_file():
        return json.loads(pointer.read_text())["name_or_path"]
    return str(name_or_path)


def _check_exists(name_or_path: str, cfg: ModelConfig) -> None:
    problem = model_source_problem(name_or_path, cfg.allow_download)
    if problem is not None:
        raise ModelLoadError(f"model.name_or_path: {problem}")


def load_tokenizer(name_or_path: str | Path, cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Load a tokenizer, left-padded, with a pad token (``cfg.pad_token`` or eos when it has none)."""
    source = resolve(name_or_path)
    _check_exists(source, cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=cfg.trust_remote_code, local_files_only=not cfg.allow_download
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model.name_or_path: cannot load a tokenizer from {source!r} ({exc}); nothing is "
            "downloaded at run time: point to a local folder or a hub id already in the cache"
        ) from None
    tokenizer.padding_side = "left"
    if cfg.pad_token is not None:
        tokenizer.pad_token = cfg.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ModelLoadError(
            f"model.name_or_path: the tokenizer of {source!r} has no chat template; use an instruct "
            "model's tokenizer or add a chat_template to its tokenizer_config.json"
        )
    return tokenizer


def load_model(name_or_path: str | Path, cfg: ModelConfig) -> PreTrainedModel:
    """Load a causal LM from a local folder (safetensors only) or the local hub cache."""
    source = resolve(name_or_path)
    _check_exists(source, cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=getattr(torch, cfg.dtype),
            attn_implementation=attention_kernel(cfg.attn_implementation),
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True,
            local_files_only=not cfg.allow_download,
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model.name_or_path: cannot load a model from {source!r} ({exc}); nothing is downloaded "
            "at run time: point to a local folder with safetensors weights or a cached hub id"
        ) from None
    return fp32_head(model)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path,
               state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save weights (safetensors) and tokenizer side by side; ``state_dict``: the weights to write
    instead of the model's own (whole tensors gathered from a sharded model)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(out_dir)


# --------------------------------------------------------------------------- LoRA


def wrap_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel:
    """Add a LoRA adapter with peft; only the adapter weights stay trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    missing = [name for name in cfg.target_modules if not any(n.endswith(name) for n, _ in model.named_modules())]
    if missing:
        raise ValueError(
            f"model.lora.target_modules: {missing} match no module of {type(model).__name__}; "
            "use names such as q_proj, k_proj, v_proj, o_proj"
        )
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)
