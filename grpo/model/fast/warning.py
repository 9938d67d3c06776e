"""How a fast path says it fell back: one warning naming the path, why, and what runs instead."""

from __future__ import annotations

import warnings


class FastPathWarning(UserWarning):
    """A fast path's self-check failed: the library's own path runs instead (the numbers are the library's)."""


def fall_back(path: str, reason: str, instead: str) -> None:
    """Warn that ``path`` fell back to ``instead`` because ``reason``."""
    warnings.warn(
        f"fast path {path!r} fell back to {instead}: {reason} (model.fast_paths: off runs every library path)",
        FastPathWarning,
        stacklevel=3,
    )
