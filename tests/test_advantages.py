"""Tests of grpo/core/advantages.py: I12 (zero-variance groups give exactly 0 and are counted)."""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

from grpo.core.advantages import AdvantageError, group_advantages, group_advantages_loop


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_i12_zero_variance_groups_give_zero_advantage_and_are_counted(scale_rewards):
    # Group 0: 0.9 three times; group 1 varies; group 2 is all zeros.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 0.25, 0.0, 0.0, 0.0])
    # The fp32 mean of three 0.9 is not 0.9: unmasked, this float noise (/ eps) would leak.
    assert (rewards[:3] - rewards[:3].mean()).abs().max() > 0
    advantages, stats = group_advantages(rewards, group_size=3, scale_rewards=scale_rewards)
    assert advantages.shape == (9,)
    assert torch.equal(advantages[:3], torch.zeros(3)) and torch.equal(advantages[6:], torch.zeros(3))
    assert (advantages[3:6] != 0).all()
    assert stats["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert torch.isfinite(advantages).all()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.9, 3e38], ids=["inexact-mean", "overflowing-sum"])
def test_i12_equal_rewards_are_found_by_equality_not_by_their_std(scale_rewards, value):
    """A group's rewards being equal is read off the rewards themselves, not off a computed std: that std is 0
    for most equal groups but not for all (a batch of one prompt whose equal rewards have an inexact fp32 mean
    has a std of 7e-8; equal rewards whose sum overflows, a std of inf), and the group's advantage is still
    exactly 0."""
    rewards = torch.tensor([value] * 3)
    assert not bool(rewards.reshape(1, 3).std(dim=-1).eq(0).all())  # the std does not say "equal"
    advantages, stats = group_advantages(rewards, group_size=3, scale_rewards=scale_rewards)
    assert torch.equal(advantages, torch.zeros(3))
    assert stats["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize(("scale_rewards", "group_size"), itertools.product(["group", "batch", "none"], [1, 2, 4]))
def test_i12_all_groups_zero_std_give_all_zeros_and_frac_one(scale_rewards, group_size):
    rewards = torch.tensor([0.3] * 4 + [1.0] * 4)
    advantages, stats = group_advantages(rewards, group_size, scale_rewards)
    assert torch.equal(advantages, torch.zeros(8))
    assert stats["frac_reward_zero_std"] == 1.0
    assert stats["reward_std"] == 0.0 and stats["advantages/abs_mean"] == 0.0
    assert all(value == value for value in stats.values())  # no NaN anywhere


def test_group_mode_hand_example_and_stats():
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0])  # groups (0, 1) and (2, 2)
    advantages, stats = group_advantages(rewards, group_size=2, scale_rewards="group", eps=0.0)
    std = statistics.stdev([0.0, 1.0])  # unbiased, sqrt(0.5)
    torch.testing.assert_close(advantages, torch.tensor([-0.5 / std, 0.5 / std, 0.0, 0.0]), atol=1e-6, rtol=0)
    assert stats["reward"] == pytest.approx(1.25)
    assert stats["reward_std"] == pytest.approx(std / 2)
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert stats["advantages/abs_mean"] == pytest.approx(0.5 / std / 2)


def test_batch_mode_divides_by_the_batch_std():
    rewards = torch.tensor([0.0, 1.0, 0.0, 3.0])
    advantages, _ = group_advantages(rewards, group_size=2, scale_rewards="batch", eps=1e-4)
    batch_std = statistics.stdev([0.0, 1.0, 0.0, 3.0])
    expected = torch.tensor([-0.5, 0.5, -1.5, 1.5]) / (batch_std + 1e-4)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_batch_mode_takes_a_given_global_batch_std():
    """Several processes: the std of the global batch, passed in, replaces this process's own."""
    rewards = torch.tensor([0.0, 1.0, 0.0, 3.0])
    advantages, _ = group_advantages(rewards, group_size=2, scale_rewards="batch", eps=1e-4, batch_std=2.5)
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5, -1.5, 1.5]) / (2.5 + 1e-4), atol=1e-6, rtol=0)


def test_none_mode_only_centres():
    advantages, _ = group_advantages(torch.tensor([0.0, 4.0, 1.0, 2.0]), group_size=2, scale_rewards="none")
    assert torch.equal(advantages, torch.tensor([-2.0, 2.0, -0.5, 0.5]))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_loop_and_vectorised_agree_over_sizes_group_sizes_and_seeds(scale_rewards):
    for n_groups, group_size, seed in itertools.product([1, 3, 8], [1, 2, 4, 7], range(3)):
        gen = torch.Generator().manual_seed(seed)
        n = n_groups * group_size
        # Binary rewards make zero-variance groups common; continuous ones make them rare.
        for rewards in (torch.randint(0, 2, (n,), generator=gen).float(), torch.rand(n, generator=gen)):
            vectorised, _ = group_advantages(rewards, group_size, scale_rewards)
            looped = group_advantages_loop(rewards, group_size, scale_rewards)
            torch.testing.assert_close(vectorised, looped, atol=1e-5, rtol=1e-5)


def test_rewards_not_a_multiple_of_group_size_name_the_values():
    with pytest.raises(AdvantageError, match=r"7 rewards .*group_size=3"):
        group_advantages(torch.zeros(7), group_size=3)
    with pytest.raises(AdvantageError, match=r"4 rewards .*group_size=0"):  # not a ZeroDivisionError
        group_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(AdvantageError, match="scale_rewards"):
        group_advantages(torch.zeros(4), group_size=2, scale_rewards="global")
