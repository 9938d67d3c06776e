"""Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300) with explicit zero-variance groups (I12).

A group is the ``G`` completions of one prompt; its rows are contiguous (``N = n_groups * G``).
Each reward is centred by its group's mean and optionally divided by a standard deviation. A
group whose rewards are all equal carries no learning signal: its advantage is exactly 0 (masked,
so float noise of the mean cannot leak) and it is counted in ``frac_reward_zero_std`` so a
training run stuck on such groups is seen, not silently frozen.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch

from grpo.errors import GrpoError

ScaleRewards = Literal["group", "batch", "none"]
SCALE_MODES = ("group", "batch", "none")
T = TypeVar("T")


class AdvantageError(GrpoError, ValueError):
    """Rewards and group size do not fit together; the message names the values and the fix."""


def _check(n_rewards: int, group_size: int, scale_rewards: str) -> None:
    if group_size < 1 or n_rewards % group_size:
        raise AdvantageError(
            f"group_advantages: {n_rewards} rewards cannot be split into groups of group_size="
            f"{group_size}; pass rewards of n_prompts * grpo.group_size completions, grouped contiguously"
        )
    if scale_rewards not in SCALE_MODES:
        raise AdvantageError(f"grpo.loss.scale_rewards must be one of {SCALE_MODES} (got {scale_rewards!r})")


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the last axis; 0 where there is a single value (no spread to measure)."""
    if values.shape[-1] < 2:
        return torch.zeros(values.shape[:-1], dtype=values.dtype, device=values.device)
    return values.std(dim=-1)


def group_advantages(
    rewards: torch.Tensor,  # [N], N = n_groups * group_size, groups contiguous
    group_size: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
    batch_std: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages ``(r - mean_group) / (std + eps)`` -> ``(advantages [N] fp32, stats)``.

    ``scale_rewards``: ``group`` divides by the group's std, ``batch`` by the std of all N rewards
    (less noisy for small G; ``batch_std``, where given, is that std over the global batch of several
    processes, each holding N of its rows), ``none`` not at all (Dr. GRPO, arXiv 2503.20783: the std division
    up-weights near-uniform groups). Stats: ``reward`` (mean), ``reward_std`` (mean of per-group
    std), ``frac_reward_zero_std`` (share of groups with all rewards equal), ``advantages/abs_mean``.
    """
    _check(rewards.shape[0], group_size, scale_rewards)
    grouped = rewards.float().reshape(-1, group_size)  # [n_groups, G]
    centred = grouped - grouped.mean(dim=-1, keepdim=True)  # [n_groups, G]
    group_std = _std(grouped)  # [n_groups]
    if scale_rewards == "group":
        centred = centred / (group_std.unsqueeze(-1) + eps)
    elif scale_rewards == "batch":
        centred = centred / ((_std(grouped.reshape(-1)) if batch_std is None else batch_std) + eps)
    zero_std = grouped.amax(dim=-1) == grouped.amin(dim=-1)  # [n_groups], exact equality
    advantages = torch.where(zero_std.unsqueeze(-1), torch.zeros_like(centred), centred).reshape(-1)
    stats = {
        "reward": float(grouped.mean()),
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float(zero_std.float().mean()),
        "advantages/abs_mean": float(advantages.abs().mean()),
    }
    return advantages, stats


def per_row(per_group: Sequence[T], group_size: int) -> list[T]:
    """Rollout row ``i`` answers prompt ``i // group_size``: each item repeated ``group_size`` times -> [N].

    The one place that layout is written; the rollout, rewards, step and evaluation all go through it.
    """
    return [item for item in per_group for _ in range(group_size)]


def group_rows(groups: Sequence[int], group_size: int) -> torch.Tensor:
    """Row indices of the given prompt groups, in that order -> [len(groups) * group_size] long."""
    return torch.tensor([g * group_size + i for g in groups for i in range(group_size)], dtype=torch.long)


def group_advantages_loop(
    rewards: torch.Tensor,  # [N]
    group_size: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Plain-Python reference of ``group_advantages`` (one group at a time), for tests -> [N]."""
    _check(rewards.shape[0], group_size, scale_rewards)
    values = [float(r) for r in rewards]
    batch_std = statistics.stdev(values) if len(values) > 1 else 0.0
    out: list[float] = []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        if max(group) == min(group):
            out.extend([0.0] * group_size)
            continue
        mean = statistics.fmean(group)
        scale = {"group": statistics.stdev(group) + eps, "batch": batch_std + eps, "none": 1.0}
        out.extend((r - mean) / scale[scale_rewards] for r in group)
    return torch.tensor(out, dtype=torch.float32)
