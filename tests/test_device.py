"""grpo/model/device.py: the C allocator keeps what a step frees (no page faults to refill it each step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFILL = """
import resource, sys, torch
if sys.argv[1] == "retain":
    from grpo.model.device import retain_freed_memory
    assert retain_freed_memory()
for _ in range(4):  # 64 MB, as a step's largest activations come and go; the heap settles within
    torch.ones(16 << 20)  # the first few (the interpreter's own allocations move its top meanwhile)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(16 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", REFILL, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_memory_is_not_faulted_in_again_at_every_allocation():
    """By default glibc maps a 64 MB block fresh at each allocation (16384 page faults each time);
    with ``retain_freed_memory`` the freed block is reused once the heap has settled, as from a run's
    second step on."""
    default, retained = page_faults("default"), page_faults("retain")
    assert default >= 4 * 16384 * 0.9
    assert retained * 3 < default


TROUGH = """
import ctypes, resource, sys
from grpo.model.device import retain_freed_memory
assert retain_freed_memory(**({"trim_above": int(sys.argv[1])} if sys.argv[1] != "default" else {}))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
SIZE = 200 << 20  # malloc's own blocks, as torch's CPU allocator takes them, without Python objects between
def peak():  # six 200 MB blocks live at once, written, then all freed: the heap's top is 1.2 GB of free memory
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(SIZE) for _ in range(6)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in reversed(blocks):
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
peak()
print(min(peak() for _ in range(3)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_whose_trough_frees_more_than_a_trim_threshold_keeps_its_memory():
    """A step that frees 1.2 GB at once (SmolLM2's update frees several 200 MB logit tensors together):
    with a finite trim threshold below that, glibc returns the whole free top and the next step faults
    all of it in again (300k pages); ``retain_freed_memory`` keeps it by default."""

    def faults(trim: str) -> int:
        done = subprocess.run([sys.executable, "-c", TROUGH, trim], cwd=ROOT, capture_output=True, text=True, check=True)
        return int(done.stdout.strip().splitlines()[-1])

    assert faults(str(1 << 30)) >= 6 * 51200 * 0.9  # the case is real: a 1 GB threshold re-faults every block
    assert faults("default") < 51200 * 0.5


def test_make_accelerator_on_cpu_retains_freed_memory(monkeypatch):
    import grpo.model.device as device

    calls = []
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "retain_freed_memory", lambda: calls.append(True) or True)
    assert device.make_accelerator().device.type == "cpu"
    assert calls == [True]
