"""One writer per output folder: an exclusive lock held for a stage's whole run.

Every stage that writes takes ``folder_lock`` on its output folders (run folder, model folder, data
folder), with DVC or without. The lock is an OS file lock (``flock``) on a file named after the
folder's absolute path under ``<tmp>/grpo-locks/`` (outside the project, so outputs and DVC hashes
stay byte-identical and a stage writes nothing when it is refused): it
is released when the process ends, however it ends (``kill -9`` included), so a crash never leaves
a stale lock. The file names the holder's PID, command and start time for the error of the second
writer. A distributed run (``torchrun``, ``accelerate launch``) is one writer: its rank 0 holds the
lock for all its processes.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from grpo.errors import GrpoError

_HELD: set[Path] = set()
"""Folders this process holds (a stage calling another on the same folder does not lock itself out)."""


def lock_path(folder: Path) -> Path:
    """Where the lock of ``folder`` lives: ``<tmp>/grpo-locks/<hash of its absolute path>.lock``."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / "grpo-locks" / f"{folder.name}-{digest}.lock"


class FolderLockedError(GrpoError):
    """Another process is writing the same output folder."""


@contextmanager
def _one_lock(folder: Path) -> Iterator[None]:
    if folder in _HELD:
        yield
        return
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the lock's lifetime
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise FolderLockedError(
                f"{folder} is being written by {holder}; wait for it to finish (or stop it), "
                "or give this run its own folder (paths.* / experiment in params.yaml)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"PID {os.getpid()} (`{' '.join(sys.argv)}`, in {os.getcwd()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n"
        )
        handle.flush()
        _HELD.add(folder)
        try:
            yield
        finally:
            _HELD.discard(folder)
    finally:
        handle.close()  # closing releases the flock


@contextmanager
def folder_lock(*folders: str | Path) -> Iterator[None]:
    """Hold the write lock of every folder (in a fixed order, so two stages cannot deadlock)."""
    with ExitStack() as stack:
        if os.environ.get("RANK", "0") != "0":  # another process of a distributed run: rank 0 holds it
            folders = ()
        for folder in sorted({Path(folder).resolve() for folder in folders}):
            stack.enter_context(_one_lock(folder))
        yield


def writes(*folders: Callable[[Any], str | Path]) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a stage's ``run(cfg, **options)``: it holds the lock of each ``folder(cfg)`` while it runs."""

    def wrap(run: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(run)
        def locked(cfg: Any, *args: Any, **options: Any) -> int:
            with folder_lock(*(folder(cfg) for folder in folders)):
                return run(cfg, *args, **options)

        return locked

    return wrap
