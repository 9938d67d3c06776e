"""Test helper: every network attempt of a command and of every process it starts, seen by the kernel.

W&B's service is a Go binary (``wandb-core``), so a monkeypatched ``socket`` in Python would not see
its attempts; ``strace -f`` sees the ``connect``/``sendto`` system calls of the whole process tree, Go
or Python, before any packet leaves. An attempt is any call to a non-loopback address and any DNS
query (port 53, also to a local stub resolver such as systemd-resolved's 127.0.0.53), or a lookup
through systemd-resolved's socket. Lookups answered by nscd go through its Unix socket, which also
serves user lookups, and are not counted.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from pathlib import Path

import pytest

_SYSCALLS = "connect,sendto,sendmsg,sendmmsg"
_INET = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\).*?(?:inet_addr\(|inet_pton\(AF_INET6, )"([^"]+)"')
_RESOLVED = "/run/systemd/resolve/io.systemd.Resolve"


def strace() -> list[str]:
    """The strace command line, or a skip where strace is absent or may not trace (ptrace refused in a
    container). ``--seccomp-bpf`` where it works: only the traced calls stop the process, so torch runs
    at its speed."""
    binary = shutil.which("strace")
    if binary is None:
        pytest.skip("strace is not installed: the network-attempt check needs it")
    error = ""
    for command in ([binary, "--seccomp-bpf", "-f", "-qq"], [binary, "-f", "-qq"]):
        probe = subprocess.run([*command, "-e", "trace=connect", "true"], capture_output=True, text=True)
        if probe.returncode == 0:
            return command
        error = probe.stderr.strip()[:200]
    pytest.skip(f"strace cannot trace here ({error})")


def attempts(trace: str) -> list[str]:
    """The lines of an ``strace -f`` log that reach for the network."""
    found = []
    for line in trace.splitlines():
        if _RESOLVED in line:
            found.append(line)
            continue
        match = _INET.search(line)
        if match is None:
            continue
        port, address = int(match.group(1)), ipaddress.ip_address(match.group(2))
        mapped = getattr(address, "ipv4_mapped", None)
        if port == 53 or not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
            found.append(line)
    return found


def traced(command: list[str], log: Path, **run) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``command`` under ``strace -f``; its result and its network attempts."""
    done = subprocess.run([*strace(), "-e", f"trace={_SYSCALLS}", "-o", str(log), *command], **run)
    return done, attempts(log.read_text(encoding="utf-8", errors="replace"))
