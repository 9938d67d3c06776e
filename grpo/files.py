"""Writing outputs so a reader never sees half a file, and hashing file contents.

Every output of a stage (metrics, reports, lineage, fingerprints, processed data) is written through
``write_atomically``: the text goes to a temporary sibling, is flushed to disk, then renamed into
place (``os.replace`` is atomic on one filesystem), so a killed stage leaves the old file or the new
one, never a cut one that DVC would cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_atomically(contents: Mapping[Path, str | bytes]) -> None:
    """Write every file to a temporary sibling first, then rename them all into place.

    A failure while writing leaves every earlier file untouched; parent folders are created.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, content in contents.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            staged.append((Path(tmp), path))
            data = content.encode("utf-8") if isinstance(content, str) else content
            with os.fdopen(handle, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return the path."""
    write_atomically({Path(path): text})
    return Path(path)


def write_json(path: Path, value: Any, indent: int | None = 2, **dumps: Any) -> Path:
    """Write ``value`` as JSON (plus a final newline) to ``path`` atomically; return the path."""
    return write_text(path, json.dumps(value, indent=indent, **dumps) + "\n")


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
