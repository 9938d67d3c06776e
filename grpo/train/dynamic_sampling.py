"""Dynamic sampling (DAPO, arXiv 2503.14476): what to do with groups whose rewards are all equal.

Such a group has advantage 0 (I12) and so contributes no policy gradient; when most groups are like
that, training silently stalls. ``none`` keeps them (they are counted in ``frac_reward_zero_std`` and
the monitor watches that), ``filter`` drops them from the update, ``resample`` draws fresh prompts up
to ``max_resample`` times to refill the batch with groups that carry signal. The step
(``step.sample``) draws; this module selects and merges what it drew.

The reported ``frac_reward_zero_std`` is always that of the FIRST draw: filtering must not hide a
reward deadlock from the monitor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpo.core.advantages import group_rows, per_row
from grpo.core.prefix import PromptPrefill
from grpo.model.rollout import Rollout, concat_rollouts, select_groups

MoreRecordsFn = Callable[[int], list[dict]]
"""``more_records(attempt)``: fresh prompts for the ``attempt``-th resample (a pure function of it)."""


@dataclass(frozen=True)
class Draw:
    """One rollout of some prompts, scored."""

    rollout: Rollout
    records: list[dict]  # one per group
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    stats: dict[str, float]
    is_weights: torch.Tensor | None = None  # [N, C] truncated IS weights when another engine sampled
    prefills: tuple[
        PromptPrefill, ...
    ] = ()  # the rollout's prefill kept for the update; a selection drops it

    @functools.cached_property
    def tasks(self) -> list[str]:
        """The task of every row: row ``i`` answers ``records[i // group_size]`` -> [N]."""
        return per_row([record["task"] for record in self.records], self.rollout.group_size)

    def informative_groups(self) -> list[int]:
        """Groups whose rewards are not all equal (the ones with a non-zero advantage possible)."""
        g = self.rollout.group_size
        grouped = self.rewards.view(-1, g)
        return [i for i, row in enumerate(grouped) if bool(row.max() != row.min())]

    def select(self, groups: Sequence[int]) -> Draw:
        g = self.rollout.group_size
        rows = group_rows(groups, g)
        weights = None if self.is_weights is None else self.is_weights[rows]
        return Draw(
            select_groups(self.rollout, groups),
            [self.records[i] for i in groups],
            self.rewards[rows],
            self.advantages[rows],
            self.stats,
            weights,
        )


def merge_draws(first: Draw, kept: list[Draw], wanted: int, pad_id: int, stats: dict[str, float]) -> Draw:
    """The groups to train on: the kept groups of every draw, up to ``wanted``. When no group carries
    signal the first draw is kept: its advantages are all exactly 0, so only the KL and entropy terms act."""
    kept = [d for d in kept if d.records]
    if not kept:
        return first
    merged = Draw(
        concat_rollouts([d.rollout for d in kept], pad_id),
        [r for d in kept for r in d.records],
        torch.cat([d.rewards for d in kept]),
        torch.cat([d.advantages for d in kept]),
        stats,
        _concat_weights([d.is_weights for d in kept]),
    )
    return merged.select(list(range(min(wanted, len(merged.records)))))


def _concat_weights(weights: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Stack [n_i, C_i] weights, right-padded with 0 to the widest completion (as concat_rollouts)."""
    if any(w is None for w in weights):
        return None
    width = max(w.shape[1] for w in weights)
    return torch.cat([torch.nn.functional.pad(w, (0, width - w.shape[1])) for w in weights])
