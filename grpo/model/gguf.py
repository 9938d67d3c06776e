"""GGUF files as base models: converted once, in the ``base`` stage, into a Hugging Face folder whose
tokenizer says what the file says.

transformers reads GGUF (``from_pretrained(folder, gguf_file=...)``, weights dequantised to fp32), but
its tokenizer conversion of a Llama-architecture file with a GPT-2-style vocabulary (SmolLM2) is wrong
in ways that are exactly the boundary bugs this pipeline exists to stop: eos is taken from the bos id
(SmolLM2's turn-start ``<|im_start|>`` becomes a stop token, and the pad token by default), bos and eos
swap places, ``add_bos_token: false`` is ignored (a bos-prepending post-processor makes every encoded
text start with the start token, so rendered chat text that already has one starts with two) and the
file's pad id is dropped. ``repair_tokenizer`` rebuilds those from the file's own metadata, and the
gate refuses a tokenizer that still has them (``grpo/checks/tokenizer_boundary.py``).

The chat template is the file's own, with its built-in default system prompt (SmolLM2: "You are a
helpful AI assistant named SmolLM, trained by Hugging Face") replaced by the project's, so a
conversation that omits the system turn renders the same system text the pipeline trains with.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import decoders, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from grpo.errors import GrpoError
from grpo.model.chat import SYSTEM_PROMPT


class GgufError(GrpoError):
    """A GGUF file the pipeline cannot convert; the message names the file, the field and the fix."""


class GgufSpecials(NamedTuple):
    """What a GGUF file's ``tokenizer.ggml.*`` metadata says about its special tokens."""

    tokens: list[str]  # [V] the vocabulary, in id order
    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    chat_template: str | None


def _field(reader, key: str):
    """The value of metadata field ``key`` (a scalar, a string, or a list of them), None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


GGUF_MAGIC = b"GGUF"
_GET_IT_AGAIN = (
    "download or convert the file again (llama.cpp's convert_hf_to_gguf.py) and compare its size and "
    "sha256 with the source's"
)


def open_gguf(path: Path):
    """The ``GGUFReader`` of ``path``, or GgufError naming the file, what is wrong and what to do when it
    is not a whole GGUF file: empty, another format, cut short anywhere, or without tensors.

    The reader alone fails on such files with its own errors (``GGUF magic invalid``, an IndexError,
    a numpy dtype error) that name no file.
    """
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(len(GGUF_MAGIC))
    if size == 0:
        raise GgufError(f"{path}: the file is empty (0 bytes); {_GET_IT_AGAIN}")
    if head != GGUF_MAGIC:
        raise GgufError(
            f"{path}: not a GGUF file: it begins with {head!r}, a GGUF file with {GGUF_MAGIC!r} (a "
            "safetensors or PyTorch file, or a page saved by a failed download, under a .gguf name?); "
            "give model.name_or_path the path of a .gguf file, or the folder of a Hugging Face model"
        )
    try:
        reader = GGUFReader(str(path))  # reads the header, the metadata and every tensor's extent
    except (ValueError, IndexError, OverflowError) as exc:
        raise GgufError(
            f"{path}: cut short or corrupt: the GGUF reader fails on its {size} bytes ({exc}); {_GET_IT_AGAIN}"
        ) from None
    if not reader.tensors:  # llama.cpp's vocab-only files, or a header written without its tensors
        raise GgufError(
            f"{path}: a GGUF file without any tensor ({size} bytes): it holds no weights (a vocab-only "
            f"file?); {_GET_IT_AGAIN}"
        )
    return reader


def read_specials(path: Path) -> GgufSpecials:
    """The special-token metadata of the GGUF file ``path`` (GgufError when the file is broken)."""
    reader = open_gguf(path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if not tokens or eos is None:
        raise GgufError(
            f"{path}: no tokenizer.ggml.tokens or tokenizer.ggml.eos_token_id in its metadata; the "
            "pipeline needs the file's own vocabulary and end token: convert the model again with "
            "llama.cpp's convert_hf_to_gguf.py"
        )

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    return GgufSpecials(
        list(tokens),
        str(_field(reader, "tokenizer.ggml.model") or "gpt2"),
        token_id("bos_token_id"),
        int(eos),
        token_id("padding_token_id"),
        token_id("unknown_token_id"),
        bool(add_bos) if add_bos is not None else False,
        _field(reader, "tokenizer.chat_template"),
    )


def raw_conversion(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """What transformers alone makes of the file: fp32 weights, and the tokenizer with the faults above."""
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model, loaded = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise GgufError(
            f"{path}: transformers cannot convert it ({type(exc).__name__}: {exc}); the pipeline "
            "converts Llama-family GGUF files (general.architecture llama, qwen2, ...)"
        ) from None
    except RuntimeError as exc:  # torch's load_state_dict: a tensor of another shape than the metadata's
        if "size mismatch" not in str(exc):
            raise
        shapes = "; ".join(line.strip() for line in str(exc).splitlines() if "size mismatch" in line)
        raise GgufError(
            f"{path}: the file holds weights in another shape than its own metadata gives ({shapes[:400]}): "
            f"the file is corrupt or was converted with wrong hyperparameters: {_GET_IT_AGAIN}"
        ) from None
    # transformers fills a weight the file lacks with random values and only logs it.
    absent = sorted(loaded["missing_keys"]) + sorted(str(key) for key in loaded["mismatched_keys"])
    if absent:
        raise GgufError(
            f"{path}: the file lacks {len(absent)} of the model's weights or holds them in another shape "
            f"({', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''}): they would start from random "
            f"values; the file is incomplete or from another model: {_GET_IT_AGAIN}"
        )
    return model, tokenizer


def _post_processor(specials: GgufSpecials):
    """Prepend bos only where the file says so (``tokenizer.ggml.add_bos_token``)."""
    if specials.add_bos and specials.bos_id is not None:
        bos = specials.tokens[specials.bos_id]
        return processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials.bos_id)]
        )
    return processors.ByteLevel(trim_offsets=False) if specials.model == "gpt2" else None


def template_default_system(tokenizer: PreTrainedTokenizerFast) -> str:
    """The system text the chat template adds when a conversation has no system turn ('' when none)."""
    probe, user = "SYSTEM PROBE", [{"role": "user", "content": "Hello."}]
    given = tokenizer.apply_chat_template([{"role": "system", "content": probe}, *user], tokenize=False)
    bare = tokenizer.apply_chat_template(user, tokenize=False)
    head, _, tail = given.partition(probe)
    if probe not in given or not bare.startswith(head) or not bare.endswith(tail):
        return ""
    return bare[len(head) : len(bare) - len(tail)]


def with_project_system_prompt(tokenizer: PreTrainedTokenizerFast) -> str | None:
    """The chat template with its built-in default system text replaced by ``SYSTEM_PROMPT`` (the
    template unchanged when it adds none, or when that text is not a literal of its source)."""
    template = tokenizer.chat_template
    default = template_default_system(tokenizer)
    if not template or not default or default == SYSTEM_PROMPT or default not in template:
        return template
    replaced = template.replace(default, SYSTEM_PROMPT)
    tokenizer.chat_template = replaced
    if template_default_system(tokenizer) != SYSTEM_PROMPT:  # the literal was not the rendered text: keep it
        tokenizer.chat_template = template
        return template
    return replaced


def repair_tokenizer(tokenizer: PreTrainedTokenizerFast, specials: GgufSpecials) -> PreTrainedTokenizerFast:
    """A tokenizer with the file's own bos, eos, pad and ``add_bos_token``, a byte-level decoder for a
    GPT-2-style vocabulary, left padding, and the project's system prompt as its template's default."""
    backend = tokenizer.backend_tokenizer
    backend.post_processor = _post_processor(specials)
    if specials.model == "gpt2":
        backend.decoder = decoders.ByteLevel()

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else specials.tokens[token_id]

    pad_id = specials.pad_id if specials.pad_id is not None else specials.eos_id
    repaired = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token(specials.bos_id),
        eos_token=token(specials.eos_id),
        pad_token=token(pad_id),
        unk_token=token(specials.unk_id),
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=specials.chat_template or tokenizer.chat_template,
        model_input_names=["input_ids", "attention_mask"],
    )
    with_project_system_prompt(repaired)
    return repaired


def convert_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The model of the GGUF file ``path`` (fp32) with its tokenizer repaired from the file's metadata and
    its generation config's bos, eos and pad ids set from the same metadata."""
    specials = read_specials(path)
    model, raw = raw_conversion(path)
    tokenizer = repair_tokenizer(raw, specials)
    if tokenizer.chat_template is None:
        raise GgufError(
            f"{path}: no tokenizer.chat_template in its metadata; the pipeline renders every prompt "
            "with the model's own chat template: use an instruct model's GGUF file"
        )
    generation = model.generation_config
    generation.bos_token_id = specials.bos_id
    generation.eos_token_id = specials.eos_id
    generation.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id, model.config.pad_token_id = specials.eos_id, tokenizer.pad_token_id
    return model, tokenizer
