"""What a file's bytes give (its sha256, its semantic hash, its imports), remembered for the process.

The lineage checks of one stage hash the same model folders and parse the same modules many times
over (``evaluate``: 11 checks, 17 hashes of 540 MB folders); this reads each file once. An entry is
bound to the file's inode, size and mtime, and kept only when the file was last modified more than
``RACY_NS`` before it was read (git's "racily clean" rule): a file changed again within the file
system's timestamp granularity after that read could keep its mtime, so it is read anew each time
until it has aged. Bookkeeping: no stage's fingerprint covers this module, since it changes no artifact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from grpo.files import file_sha256

T = TypeVar("T")

RACY_NS = 2_000_000_000
"""A file modified less than this before it was read is read again next time."""

_MEMO: dict[tuple[Any, ...], tuple[tuple[int, int, int], Any]] = {}
"""``(kind, resolved path, *args)`` -> ``((inode, size, mtime_ns), value)``: one entry a file and use."""


def _state(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def memo_by_stat(kind: str, path: Path, compute: Callable[..., T], *args: Any) -> T:
    """``compute(path, *args)``, computed once per process while the file keeps its inode, size and mtime."""
    path = Path(path)
    key, state = (kind, str(path.resolve()), *args), _state(path)
    kept = _MEMO.get(key)
    if kept is not None and kept[0] == state:
        return kept[1]
    read_at = time.time_ns()
    value = compute(path, *args)
    if _state(path) == state and read_at - state[2] > RACY_NS:
        _MEMO[key] = (state, value)
    return value


def file_sha256_memo(path: Path) -> str:
    """``file_sha256`` through ``memo_by_stat``: an unchanged file is hashed once per process."""
    return memo_by_stat("sha256", path, file_sha256)
