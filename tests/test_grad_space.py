"""grpo/core/grad_space.py: the per-task combination on gradient shards equals it on whole gradients.

Two threads stand for two FSDP processes: each holds one half of every flat gradient, and their
``all_reduce`` sums a tensor over both (a barrier exchange), as the gloo all-reduce does between
processes. The end-to-end check with real FSDP2 processes is
tests/test_distributed.py::test_two_fsdp_processes_train_like_one_unsharded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from grpo.core.grad_space import REPLICATED, ShardedGradSpace
from grpo.core.multitask import combine


class ThreadSum:
    """``all_reduce`` SUM between ``n`` threads."""

    def __init__(self, n: int) -> None:
        self.barrier, self.slots = threading.Barrier(n), [torch.zeros(0)] * n

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        return all_reduce


def on_shards(n: int, work: Callable[[int, ShardedGradSpace], object]) -> list:
    """``work(rank, space)`` on ``n`` threads, each with a sharded space over the others."""
    summer, results, errors = ThreadSum(n), [None] * n, []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, ShardedGradSpace(summer.for_rank(rank)))
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
            summer.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def conflicting_grads(seed: int) -> torch.Tensor:
    """Two task gradients [2, 11] with a negative dot product (PCGrad projects, CAGrad's weights move)."""
    grads = torch.randn(2, 11, generator=torch.Generator().manual_seed(seed))
    grads[1] -= 1.5 * grads[0]
    assert float(grads[0] @ grads[1]) < 0
    return grads


@pytest.mark.parametrize("mode", ["sum", "pcgrad", "cagrad"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_on_shards_equals_combine_on_whole_gradients(mode, seed):
    """Each shard's direction is the whole direction's slice; the statistics are the whole ones."""
    grads = conflicting_grads(seed)
    halves = torch.tensor_split(grads, 2, dim=1)  # uneven: 6 and 5 elements
    want, want_stats = combine(grads, mode, 0.5, 1, ("fairness", "hallucination"), REPLICATED.inner)
    got = on_shards(2, lambda rank, space: combine(halves[rank], mode, 0.5, 1, ("fairness", "hallucination"),
                                                    space.inner))
    torch.testing.assert_close(torch.cat([got[0][0], got[1][0]]), want, rtol=1e-5, atol=1e-6)
    for stats in (got[0][1], got[1][1]):
        assert stats.keys() == want_stats.keys()
        for key, value in want_stats.items():
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_sharded_clip_uses_the_norm_of_the_whole_gradient():
    """Every shard reports the whole norm and is scaled by clip_grad_norm_'s coefficient (on values that are
    not whole numbers: a norm taken of gradients cast to integers would agree on whole ones)."""
    whole = (torch.arange(9.0) - 3.0) * 0.37  # [9]
    norm = float(whole.norm())
    pieces = torch.tensor_split(whole, 2)

    def clip(rank: int, space: ShardedGradSpace) -> tuple[float, torch.Tensor]:
        param = _with_grad(pieces[rank].clone())
        return space.clip([param], 2.0), param.grad

    results = on_shards(2, clip)
    assert [r[0] for r in results] == pytest.approx([norm, norm], rel=1e-6)
    assert norm > 2.0, "the test must clip"
    torch.testing.assert_close(torch.cat([r[1] for r in results]), _clipped(whole, 2.0))


def test_a_nan_or_a_nonzero_in_one_shard_is_seen_by_every_shard():
    """``is_finite`` and ``any`` answer for the whole gradient, the same on every process (a process
    that raised alone would leave the other waiting in the next collective)."""
    shards = [torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0])]
    assert on_shards(2, lambda rank, space: space.is_finite(shards[rank])) == [False, False]
    shards = [torch.tensor([float("-inf"), 0.0, 0.0]), torch.zeros(3)]
    assert on_shards(2, lambda rank, space: space.is_finite(shards[rank])) == [False, False]
    assert on_shards(2, lambda rank, space: space.is_finite(torch.ones(3))) == [True, True]
    shards = [torch.zeros(3), torch.tensor([0.0, 1e-30, 0.0])]
    assert on_shards(2, lambda rank, space: space.any(shards[rank])) == [True, True]
    assert on_shards(2, lambda rank, space: space.any(torch.zeros(3))) == [False, False]


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    return param


def _clipped(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    param = _with_grad(grad.clone())
    torch.nn.utils.clip_grad_norm_([param], max_norm)
    return param.grad


def test_a_sharded_flat_gradient_is_each_losss_own_and_leaves_no_grad_behind():
    """Under FSDP the gradient is taken by ``backward`` into ``.grad``: each task's flat gradient must be its
    loss's alone (the previous task's cleared), and nothing may be left in ``.grad`` for the write that adds
    the combined direction. (One process: the parameters are whole; the slicing of real shards is
    tests/test_distributed.py's.)"""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    bias = torch.nn.Parameter(torch.tensor([0.5]))
    space = ShardedGradSpace(lambda tensor: tensor)
    first = space.flat_grad((weight * weight).sum() + 2 * bias.sum(), [weight, bias], retain=False)
    second = space.flat_grad((3 * weight).sum(), [weight, bias], retain=False)
    torch.testing.assert_close(first, torch.tensor([2.0, 4.0, 6.0, 2.0]))
    torch.testing.assert_close(second, torch.tensor([3.0, 3.0, 3.0, 0.0]))
    assert weight.grad is None and bias.grad is None
    space.write([weight, bias], first + second)
    torch.testing.assert_close(torch.cat([weight.grad, bias.grad]), torch.tensor([5.0, 7.0, 9.0, 2.0]))


def test_a_gradient_that_is_only_negative_is_nonzero_on_every_shard():
    """``any`` asks "is any element not zero": a task whose gradient points only down must take part in
    the combination, whichever shard holds its nonzero elements."""
    assert REPLICATED.any(torch.tensor([0.0, -2.0, 0.0]))
    assert REPLICATED.any(torch.tensor([-1e-30]))
    shards = [torch.zeros(3), torch.tensor([0.0, -0.5, 0.0])]
    assert on_shards(2, lambda rank, space: space.any(shards[rank])) == [True, True]


def test_write_adds_the_direction_to_gradients_already_there():
    """``write`` adds each slice of the flat direction to the parameter's ``.grad`` (creating it where
    absent), so what a parameter held before is kept, in the parameter's dtype."""
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    weight.grad = torch.ones(2, 2)
    REPLICATED.write([weight, bias], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    torch.testing.assert_close(weight.grad, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    torch.testing.assert_close(bias.grad, torch.tensor([5.0], dtype=torch.float64))
    REPLICATED.write([weight, bias], torch.full((5,), 0.5))
    torch.testing.assert_close(weight.grad, torch.tensor([[2.5, 3.5], [4.5, 5.5]]))
    torch.testing.assert_close(bias.grad, torch.tensor([5.5], dtype=torch.float64))


def test_a_zero_sharded_gradient_clips_to_itself_with_norm_zero():
    """A zero gradient (every task's advantage zero) has norm 0: the clip reports it and leaves the shards
    at zero, as ``clip_grad_norm_`` does, so the update skips the step instead of failing on every process."""

    def clip(rank: int, space: ShardedGradSpace) -> tuple[float, torch.Tensor]:
        param = _with_grad(torch.zeros(3))
        return space.clip([param], 1.0), param.grad

    results = on_shards(2, clip)
    assert [r[0] for r in results] == [0.0, 0.0]
    assert all(torch.equal(r[1], torch.zeros(3)) for r in results)


def test_a_loss_without_a_graph_has_a_zero_flat_gradient_on_a_shard():
    """A loss term that reaches no weight (a KL with beta 0, a constant) has the zero gradient, sharded or
    not, without a backward through nothing."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    constant = torch.tensor(0.0)
    for space in (REPLICATED, ShardedGradSpace(lambda tensor: tensor)):
        torch.testing.assert_close(space.flat_grad(constant, [weight], retain=False), torch.zeros(2))
        assert weight.grad is None
