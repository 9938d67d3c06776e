"""``multinomial_one``: ``torch.multinomial(probs, 1)`` on a CPU, the same tokens from the same generator, without
its serial loop.

For one sample per row PyTorch draws ``q ~ Exp(1)`` for every entry (``empty_like(probs).exponential_()``)
and returns ``argmax(probs / q)``. Its CPU ``exponential_`` is a serial loop: per entry one 53-bit
uniform ``u`` from the generator (``random64``), then ``-log1p(-u)`` in double, rounded to float; over a
vocabulary of tens of thousands of tokens and a batch of rows, that loop is a large part of a decode step.
The same uniforms come from ``uniform_`` on a float64 tensor (the same ``random64`` per entry, the
generator left in the same state), and ``log1p`` over the whole tensor is vectorised, on every thread.

Vectorised ``log1p`` and the serial one may differ in the last bit of the double. The float they round
to differs only when the double lies within a few units of its last place of a float rounding
midpoint; those few entries are recomputed with the C library's ``log1p`` (Python's ``math.log1p``, the
serial kernel's). So every ``q`` is the float the serial kernel makes.

Self-check (``exponential_mismatch``, at the first draw): the two ways compared on a copy of the
generator's state; where they differ (a PyTorch whose kernel changed), ``multinomial_one`` is
``torch.multinomial`` itself, with a warning. So it is on a GPU and for other dtypes.
``tests/test_multinomial.py`` and ``tests/test_decode.py`` compare the tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from grpo.model.fast.warning import fall_back

_MIDPOINT = 1 << 28
"""Half a float ulp, in units of the double's last place (53 - 24 = 29 bits are rounded away)."""
_NEAR = 8
"""Doubles this many units of the last place from a float midpoint are recomputed serially."""


def _exponentials(shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Float32 ``Exp(1)`` draws from the global CPU generator, those of ``empty(shape).exponential_()``."""
    return _from_uniform(torch.empty(shape, dtype=torch.float64).uniform_())


def _from_uniform(uniform: torch.Tensor) -> torch.Tensor:
    """``-log1p(-u)`` of float64 uniforms rounded to float32 as the serial kernel rounds it."""
    logs = uniform.neg().log1p_()  # log1p(-u) <= 0: the draws negated, float64
    # |low 29 bits - midpoint| <= _NEAR, as one wrapped range: (bits + _NEAR - midpoint) mod 2^29 <= 2 _NEAR
    near = (logs.view(torch.int64) + (_NEAR - _MIDPOINT)).bitwise_and_((1 << 29) - 1) <= 2 * _NEAR
    if bool(near.any()):
        for index in near.nonzero().tolist():
            logs[tuple(index)] = math.log1p(-uniform[tuple(index)].item())
    return logs.float().neg_()


@functools.cache
def exponential_mismatch() -> str | None:
    """``None`` where ``_exponentials`` gives ``exponential_``'s draws and leaves the generator as it does,
    tried on a copy of the global generator's state (restored afterwards: nothing of the stream is used);
    else why not, with a warning (once per process)."""
    generator = torch.default_generator
    state = generator.get_state()
    try:
        expected = torch.empty(64, 1024).exponential_()
        after = generator.get_state()
        generator.set_state(state)
        got = _exponentials((64, 1024))
        same = torch.equal(expected, got) and torch.equal(after, generator.get_state())
    finally:
        generator.set_state(state)
    if same:
        return None
    reason = "uniform_ then log1p no longer gives exponential_'s draws on this PyTorch"
    fall_back("exponential draws", reason, "torch.multinomial")
    return reason


def multinomial_one(probs: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, 1).squeeze(1)``: one index per row of ``probs`` [N, V], from the global
    generator, with ``multinomial``'s checks and errors."""
    fast = (
        probs.device.type == "cpu"
        and probs.dtype == torch.float32
        and probs.dim() == 2
        and probs.is_contiguous()
        and exponential_mismatch() is None
    )
    if not fast:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if not bool((probs.max() < math.inf) & (probs.min() >= 0)):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(1) == 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    draws = _exponentials(probs.shape)
    return torch.div(probs, draws, out=draws).argmax(dim=-1)

