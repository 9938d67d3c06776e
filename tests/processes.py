"""Stopping what a test started: a process and the session (process group) it leads."""

from __future__ import annotations

import os
import signal
import subprocess


def stop(proc: subprocess.Popen, stragglers: bool = False) -> None:
    """SIGTERM the session ``proc`` leads (started with ``start_new_session=True``), SIGKILL it if it
    lingers. ``stragglers``: once ``proc`` has exited, SIGKILL what is left of its session too (a
    browser's helpers outlive it and keep writing to its profile)."""
    if proc.poll() is not None and not stragglers:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not stragglers:
            return
