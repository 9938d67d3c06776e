"""One writer per output folder: an exclusive lock held for a stage's whole run.

Every stage that writes takes ``folder_lock`` on its output folders (run folder, model folder, data
folder), with DVC or without. The lock is an OS file lock (``flock``) on a file beside the folder it
guards, ``<parent>/.<name>.lock`` (``models/.grpo.lock`` for ``models/grpo``), so every writer of the
folder meets the same file whatever its ``TMPDIR``, user or container (a per-job ``TMPDIR`` under
SLURM, systemd's ``PrivateTmp`` or two users on one machine would each see their own lock under
``/tmp``). Beside, not inside: a DVC output folder hashes everything in it, and a refused stage writes
nothing into the folder; git and DVC ignore ``.*.lock`` (``.gitignore``, ``.dvcignore``). The lock is
released by the kernel when the process ends, however it ends (``kill -9`` included), so a crash never
leaves a stale lock: the file stays, and the next writer takes it and writes its own holder line.
That line names the holder's PID, host, command and start time for the error of the second writer.
A distributed run (``torchrun``, ``accelerate launch``) is one writer: its rank 0 holds the lock for
all its processes. What the lock guarantees on a network file system: docs/configuration.md "Locks".
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from grpo.errors import GrpoError

_HELD: set[Path] = set()
"""Folders this process holds (a stage calling another on the same folder does not lock itself out)."""


def lock_path(folder: Path) -> Path:
    """Where the lock of ``folder`` lives: ``<parent>/.<name>.lock`` beside its resolved path."""
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


class FolderLockedError(GrpoError):
    """Another process is writing the same output folder, or the folder's file system refuses locks."""


def _open_lock(folder: Path):
    path = lock_path(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the lock's lifetime
    except OSError as exc:
        raise FolderLockedError(
            f"cannot create the lock file {path} of {folder} ({exc.strerror}): a stage writes its folder "
            f"only while it holds that lock; make {path.parent} writable, or give the run other folders "
            "(paths.* in params.yaml)"
        ) from None


def _take(handle, folder: Path) -> None:
    """Take the exclusive lock on ``handle`` at once, or raise naming the holder."""
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        raise FolderLockedError(
            f"{folder} is being written by {holder}; wait for it to finish (or stop it), "
            "or give this run its own folder (paths.* / experiment in params.yaml)"
        ) from None
    except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: a file system mounted without locks
        raise FolderLockedError(
            f"{folder}: its file system refuses the lock on {lock_path(folder)} ({exc.strerror}), so a second "
            "writer could not be kept out; mount it with locks (NFS: without nolock or local_lock; Lustre: "
            "-o flock) or put paths.* on a local disk (docs/configuration.md, Locks)"
        ) from None


@contextmanager
def _one_lock(folder: Path) -> Iterator[None]:
    if folder in _HELD:
        yield
        return
    handle = _open_lock(folder)
    try:
        _take(handle, folder)
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"PID {os.getpid()} on {socket.gethostname()} (`{' '.join(sys.argv)}`, in {os.getcwd()}, since "
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
