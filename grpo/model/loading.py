"""Loading and saving models and tokenizers: real models by path or hub id, the base pointer file.

Every stage loads through ``load_model``/``load_tokenizer``; nothing is downloaded (the hub is used only
as a local cache) and ``trust_remote_code`` stays off unless params turn it on. The LM head of every
loaded model computes in fp32 (``precision.fp32_head``), its product as ``model.fast_paths`` says.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import ModelConfig
from grpo.errors import GrpoError
from grpo.files import write_json
from grpo.model.fast import FastPaths
from grpo.model.kernels import attention_kernel
from grpo.model.precision import fp32_head
from grpo.offline import model_source_problem

POINTER_FILE = "grpo_base.json"


class ModelLoadError(GrpoError, OSError):
    """A model or tokenizer could not be loaded; the message names the path and the fix."""


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


_WRITE_AGAIN = (
    "the save or copy did not finish (a kill, a full disk, an interrupted download); write it again: rerun "
    "the stage that wrote it (`dvc repro`; `grpo base`, `grpo sft` or `grpo train` for models/base, sft, "
    "grpo), or copy the model again"
)


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` is not whole (None when it is): its 8-byte header length, its
    JSON index of tensors and where the last tensor ends, against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"cut short: {size} bytes, less than the 8 that give its header's length"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"cut short: its header should take {length} bytes, the file holds {size - 8} after the length"
        try:
            index = json.loads(handle.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in index.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return f"corrupt: its header is not the JSON index of its tensors ({exc})"
    expected = 8 + length + end
    if size < expected:
        return f"cut short: its tensors end at byte {expected}, the file holds {size} ({expected - size} missing)"
    if size > expected:
        return f"corrupt: {size - expected} bytes follow its last tensor"
    return None


def check_weight_files(folder: Path) -> None:
    """ModelLoadError naming the first ``*.safetensors`` file of ``folder`` that is not whole (the loader
    alone fails with ``SafetensorError: ... incomplete metadata``, naming no file)."""
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            raise ModelLoadError(f"{path}: not a whole safetensors file, {problem}; {_WRITE_AGAIN}")


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
    if Path(source).is_dir():
        check_weight_files(Path(source))
    try:
        model, loaded = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=getattr(torch, cfg.dtype),
            attn_implementation=attention_kernel(cfg.attn_implementation),
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True,
            local_files_only=not cfg.allow_download,
            output_loading_info=True,
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model.name_or_path: cannot load a model from {source!r} ({exc}); nothing is downloaded "
            "at run time: point to a local folder with safetensors weights or a cached hub id"
        ) from None
    missing = sorted(loaded["missing_keys"])  # transformers fills them with random values and only logs it
    if missing:
        raise ModelLoadError(
            f"{source}: its weight files lack {len(missing)} of the model's weights ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): they would start from random values; {_WRITE_AGAIN}"
        )
    return fp32_head(model, FastPaths.resolve(cfg.fast_paths))


def save_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save weights (safetensors) and tokenizer side by side; ``state_dict``: the weights to write
    instead of the model's own (whole tensors gathered from a sharded model)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(out_dir)
