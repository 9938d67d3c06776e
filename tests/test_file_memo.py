"""Tests for grpo/provenance/file_memo.py: a file read once per process, and again after any change."""

from __future__ import annotations

import hashlib
import os
import time

from grpo.provenance.file_memo import RACY_NS, file_sha256_memo, memo_by_stat


def _age(paths, seconds=1_000):
    """Push mtimes into the past, as a model folder written an hour ago has them."""
    for path in paths:
        stamp = time.time_ns() - seconds * 1_000_000_000
        os.utime(path, ns=(stamp, stamp))


def _counting(reads):
    def compute(path, *args):
        reads.append((path.name, args))
        return path.read_bytes() + repr(args).encode()

    return compute


def test_memo_by_stat_reads_an_aged_file_once_and_again_after_any_change(tmp_path):
    reads = []
    compute = _counting(reads)
    path = tmp_path / "w.bin"
    path.write_bytes(b"aaaa")
    _age([path])
    assert memo_by_stat("t", path, compute) == b"aaaa()"
    assert memo_by_stat("t", path, compute) == b"aaaa()"
    assert len(reads) == 1
    assert memo_by_stat("t", path, compute, "x") == b"aaaa('x',)"  # other arguments, another entry
    assert len(reads) == 2
    with path.open("r+b") as handle:  # edited in place, same size: the mtime moves
        handle.write(b"b")
    assert memo_by_stat("t", path, compute) == b"baaa()"
    _age([path])
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"cccc")
    _age([replacement], 500)
    os.replace(replacement, path)  # replaced as write_atomically does: a new inode, the same size
    assert memo_by_stat("t", path, compute) == b"cccc()"
    assert len(reads) == 4
    kept = path.stat().st_mtime_ns
    copy = tmp_path / "copy.bin"
    copy.write_bytes(b"dddd")
    os.utime(copy, ns=(kept, kept))  # `cp -p`, `rsync -t`: the same size and mtime, only the inode differs
    os.replace(copy, path)
    assert memo_by_stat("t", path, compute) == b"dddd()"
    assert len(reads) == 5


def test_memo_by_stat_reads_a_racily_fresh_file_every_time(tmp_path):
    """A file modified within RACY_NS of the read may change again without moving its mtime."""
    reads = []
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"1")
    assert time.time_ns() - path.stat().st_mtime_ns < RACY_NS
    for _ in range(3):
        memo_by_stat("t", path, _counting(reads))
    assert len(reads) == 3
    before = path.stat().st_mtime_ns
    path.write_bytes(b"2")
    os.utime(path, ns=(before, before))  # a change the timestamps cannot show
    assert memo_by_stat("t", path, _counting(reads)) == b"2()"


def test_file_sha256_memo_is_the_sha256_of_the_bytes(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"weights")
    _age([path])
    assert file_sha256_memo(path) == file_sha256_memo(path) == hashlib.sha256(b"weights").hexdigest()


def test_memo_by_stat_keeps_one_entry_per_file_and_use(tmp_path):
    """A long-lived worker hashing model after model keeps the newest version of each file only."""
    from grpo.provenance import file_memo

    path = tmp_path / "model.safetensors"
    before = len(file_memo._MEMO)
    for version in range(5):
        path.write_bytes(b"v%d" % version)
        _age([path], 1_000 - version)
        assert file_sha256_memo(path) == hashlib.sha256(b"v%d" % version).hexdigest()
    assert len(file_memo._MEMO) == before + 1


def test_memo_by_stat_reads_again_a_file_modified_half_a_second_before_it_was_read(tmp_path):
    """Half a second is within the timestamp granularity of common file systems (FAT, some network mounts:
    up to 2 s): a file that young may change again under the same mtime, so it is never remembered."""
    reads = []
    path = tmp_path / "w.bin"
    path.write_bytes(b"1111")
    stamp = time.time_ns() - 500_000_000
    os.utime(path, ns=(stamp, stamp))
    assert memo_by_stat("t", path, _counting(reads)) == b"1111()"
    path.write_bytes(b"2222")
    os.utime(path, ns=(stamp, stamp))  # the same inode, size and mtime: only a new read can tell
    assert memo_by_stat("t", path, _counting(reads)) == b"2222()"
    assert len(reads) == 2
