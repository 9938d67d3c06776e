"""Nothing is fetched from the network unless ``model.allow_download`` is true.

``grpo <command>`` (and so ``dvc repro``, whose stages are ``grpo`` commands) sets the Hugging Face
offline variables before any Hugging Face library is imported; ``model_source_problem`` says, at
config time, why a configured model cannot be loaded offline, the same way for relative and
absolute paths.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo.sources import SourceError, gguf_file, is_gguf

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_by_default() -> None:
    """Set the offline variables unless the user set them (call before Hugging Face is imported)."""
    for name in OFFLINE_ENV:
        os.environ.setdefault(name, "1")


def allow_network() -> None:
    """``model.allow_download: true``: lift the defaults set by ``offline_by_default`` (user-set values stay)."""
    for name in OFFLINE_ENV:
        if os.environ.get(name) == "1":
            os.environ[name] = "0"


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def model_source_problem(name_or_path: str, allow_download: bool) -> str | None:
    """Why ``name_or_path`` cannot be loaded (None when it can): not a folder, not a GGUF file, a named
    source whose package is not installed, not cached, no download."""
    if is_gguf(name_or_path):
        try:
            gguf_file(name_or_path)
        except SourceError as exc:
            return str(exc)
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return None
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or path.exists()
    if not looks_local and (allow_download or _in_hub_cache(name_or_path)):
        return None
    return (
        f"model folder {name_or_path!r} does not exist (looked at {path.resolve()}) and it is not a hub id "
        "in the local cache; give an existing local folder with config.json and tokenizer files, a .gguf "
        "file, a named source (smollm2-135m-instruct), or null for the embedded tiny model"
        + ("" if allow_download else " (nothing is downloaded: model.allow_download is false)")
    )
