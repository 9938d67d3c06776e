"""One way to derive a seed from the run seed and the coordinates of a draw.

A resumed run must draw exactly what an uninterrupted one drew, and two different draws (another
step, another process, a dynamic-sampling retry, another eval batch) must never share a stream. Every
derived seed therefore comes from ``derive_seed(seed, *coordinates)``: a hash of the run seed and
named integer coordinates, instead of primes multiplied in each module (which collide when two
modules pick the same ones).
"""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *coordinates: tuple[str, int]) -> int:
    """A 63-bit seed from ``seed`` and ``(name, value)`` coordinates, e.g. ``("step", 3), ("rank", 0)``.

    The names are part of the hash, so ``step=1, attempt=0`` and ``attempt=1, step=0`` differ.
    """
    text = f"{seed}" + "".join(f"|{name}={int(value)}" for name, value in coordinates)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
