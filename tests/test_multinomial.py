"""``grpo/model/fast/multinomial.py``: ``multinomial_one`` is ``torch.multinomial(probs, 1)``, the same indices from the same
generator, which it leaves in the same state."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.model.fast import FastPathWarning, multinomial


def _both(probs: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    expected = torch.multinomial(probs, num_samples=1).squeeze(1)
    state_expected = torch.get_rng_state()
    torch.manual_seed(seed)
    got = multinomial.multinomial_one(probs)
    return expected, got, state_expected, torch.get_rng_state()


@pytest.mark.parametrize("scale", [0.0, 1.0, 4.0, 30.0])
def test_multinomial_one_is_multinomials_draw(scale):
    logits = torch.randn(16, 600, generator=torch.Generator().manual_seed(1)) * scale
    probs = torch.softmax(logits, dim=-1)
    assert multinomial.exponential_mismatch() is None  # the fast path is the one compared here
    for seed in range(5):
        expected, got, state_expected, state_got = _both(probs, seed)
        assert torch.equal(got, expected)
        assert torch.equal(state_got, state_expected)  # the next draw starts where multinomial's would


def test_multinomial_one_on_a_real_vocabulary_with_filtered_entries():
    """SmolLM2's 49,152 entries, most of them zeroed as top-k leaves them, one row one-hot."""
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(2)) * 3
    probs = torch.softmax(logits, dim=-1)
    probs[:, 100:] = 0.0
    probs[3] = 0.0
    probs[3, 7] = 1.0
    expected, got, state_expected, state_got = _both(probs, 3)
    assert torch.equal(got, expected) and got[3] == 7
    assert torch.equal(state_got, state_expected)


def test_exponentials_near_a_float_midpoint_are_recomputed_serially(monkeypatch):
    """With the window widened to a quarter of all doubles, the serial recomputation decides those
    entries: they must still be ``exponential_``'s (its sign and index handling are right)."""
    monkeypatch.setattr(multinomial, "_NEAR", 1 << 26)
    torch.manual_seed(4)
    expected = torch.empty(32, 128).exponential_()
    torch.manual_seed(4)
    assert torch.equal(multinomial._exponentials((32, 128)), expected)


def test_the_self_check_leaves_the_generator_alone():
    multinomial.exponential_mismatch.cache_clear()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert multinomial.exponential_mismatch() is None
    assert torch.equal(torch.get_rng_state(), before)


def test_a_kernel_that_draws_otherwise_fails_the_self_check_with_a_warning(monkeypatch):
    """A PyTorch whose ``log1p`` or ``uniform_`` moved (here: draws one part in a million off): the self-check
    says so once, and ``multinomial_one`` is ``torch.multinomial``, the same indices and generator state."""
    from_uniform = multinomial._from_uniform
    monkeypatch.setattr(multinomial, "_from_uniform", lambda uniform: from_uniform(uniform) * (1 + 1e-6))
    multinomial.exponential_mismatch.cache_clear()
    try:
        with pytest.warns(FastPathWarning, match="'exponential draws' fell back to torch.multinomial"):
            assert multinomial.exponential_mismatch() is not None
        probs = torch.softmax(torch.randn(4, 50), dim=-1)
        expected, got, state_expected, state_got = _both(probs, 6)
        assert torch.equal(got, expected) and torch.equal(state_got, state_expected)
    finally:
        multinomial.exponential_mismatch.cache_clear()


def test_where_the_self_check_fails_multinomial_one_is_multinomial(monkeypatch):
    monkeypatch.setattr(multinomial, "exponential_mismatch", lambda: "changed")
    monkeypatch.setattr(multinomial, "_exponentials", lambda shape: pytest.fail("the fast path ran"))
    probs = torch.softmax(torch.randn(4, 50), dim=-1)
    expected, got, state_expected, state_got = _both(probs, 6)
    assert torch.equal(got, expected) and torch.equal(state_got, state_expected)


@pytest.mark.parametrize(
    "probs",
    [
        torch.softmax(torch.randn(4, 50, dtype=torch.float64), dim=-1),  # another dtype
        torch.softmax(torch.randn(50, 4), dim=0).t(),  # not contiguous
    ],
    ids=["float64", "strided"],
)
def test_other_inputs_take_multinomial_itself(monkeypatch, probs):
    monkeypatch.setattr(multinomial, "_exponentials", lambda shape: pytest.fail("the fast path ran"))
    expected, got, _, _ = _both(probs, 7)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("bad", "message"),
    [(float("nan"), "contains either `inf`, `nan` or element < 0"), (-0.1, "element < 0")],
)
def test_invalid_probabilities_raise_multinomials_error(bad, message):
    probs = torch.full((2, 10), 0.1)
    probs[1, 3] = bad
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(probs, 1)
    with pytest.raises(RuntimeError, match=message):
        multinomial.multinomial_one(probs)


def test_a_row_of_zeros_raises_multinomials_error():
    probs = torch.full((2, 10), 0.1)
    probs[0] = 0.0
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        torch.multinomial(probs, 1)
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        multinomial.multinomial_one(probs)


def _uniforms_near_float_midpoints() -> torch.Tensor:
    """Float64 uniforms whose draw ``-log1p(-u)`` lies within a unit of the last place of the midpoint
    between two floats, where vectorised and serial ``log1p`` can round to different floats."""
    floats = torch.rand(60000, generator=torch.Generator().manual_seed(8)) * 20 + 1e-3
    above = torch.nextafter(floats, torch.tensor(float("inf")))
    midpoints = (floats.double() + above.double()) / 2
    central = -torch.expm1(-midpoints)
    return torch.cat([central, torch.nextafter(central, torch.tensor(0.0, dtype=torch.float64))])


def test_draws_on_a_float_midpoint_are_the_serial_kernels():
    """Where this CPU's vectorised log1p rounds some draws to another float than the C library's (the
    serial kernel's), ``_from_uniform`` still gives the C library's float for every one."""
    uniforms = _uniforms_near_float_midpoints()
    serial = torch.tensor([-math.log1p(-u) for u in uniforms.tolist()], dtype=torch.float64).float()
    vectorised = uniforms.neg().log1p().neg().float()
    if torch.equal(vectorised, serial):
        pytest.skip("vectorised and serial log1p round alike on this CPU: no midpoint case to correct")
    assert torch.equal(multinomial._from_uniform(uniforms), serial)


def test_an_infinite_probability_raises_multinomials_error():
    probs = torch.full((2, 10), 0.1)
    probs[0, 4] = math.inf
    with pytest.raises(RuntimeError, match="contains either `inf`, `nan` or element < 0"):
        torch.multinomial(probs, 1)
    with pytest.raises(RuntimeError, match="contains either `inf`, `nan` or element < 0"):
        multinomial.multinomial_one(probs)


def test_draws_that_leave_the_generator_elsewhere_fail_the_self_check(monkeypatch):
    """A PyTorch whose ``uniform_`` gives ``exponential_``'s numbers but consumes the stream otherwise (here:
    one more draw after them): every later draw would move, so the self-check says so."""
    exponentials = multinomial._exponentials

    def one_more(shape):
        draws = exponentials(shape)
        torch.rand(1)
        return draws

    monkeypatch.setattr(multinomial, "_exponentials", one_more)
    multinomial.exponential_mismatch.cache_clear()
    try:
        with pytest.warns(FastPathWarning, match="'exponential draws' fell back to torch.multinomial"):
            assert multinomial.exponential_mismatch() is not None
    finally:
        multinomial.exponential_mismatch.cache_clear()
