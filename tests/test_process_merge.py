"""Tests of grpo/health/process_merge.py: the processes' metrics merge into those of all their rows."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.health.metrics import MetricsError
from grpo.health.process_merge import merge_process_metrics


def test_merged_metrics_are_those_of_the_concatenated_rows():
    """Two processes' reward and length statistics merge into the statistics of all rows together."""
    rewards = [torch.tensor([0.1, 0.2, 0.7, 0.7]), torch.tensor([1.0, 0.0])]  # the fairness rows of each process
    lengths = [torch.tensor([3.0, 5.0, 8.0, 2.0, 6.0, 7.0]), torch.tensor([4.0, 9.0])]  # process 0: 2 more rows
    per_process = [{"rewards/fairness/mean": float(r.mean()), "rewards/fairness/std": float(r.std(correction=0)),
                    "completions/mean_length": float(n.mean()), "completions/min_length": float(n.min()),
                    "completions/max_length": float(n.max()), "step_time": t, "tokens_per_s": float(n.sum()) / t,
                    "dynamic/kept_groups": kept, "dynamic/draws": draws, "grad_norm": 0.5}
                   for r, n, t, kept, draws in zip(rewards, lengths, (2.0, 4.0), (3.0, 2.0), (1.0, 2.0), strict=True)]
    counts = [{"rows": 6.0, "rows/fairness": 4.0, "rows/hallucination": 2.0}, {"rows": 2.0, "rows/fairness": 2.0}]
    merged = merge_process_metrics(per_process, counts)
    every_reward, every_length = torch.cat(rewards), torch.cat(lengths)
    assert math.isclose(merged["rewards/fairness/mean"], float(every_reward.mean()), rel_tol=1e-6)
    assert math.isclose(merged["rewards/fairness/std"], float(every_reward.std(correction=0)), rel_tol=1e-6)
    assert math.isclose(merged["completions/mean_length"], float(every_length.mean()), rel_tol=1e-6)
    assert (merged["completions/min_length"], merged["completions/max_length"]) == (2.0, 9.0)
    assert merged["step_time"] == 4.0 and math.isclose(merged["tokens_per_s"], 44.0 / 4.0)
    assert (merged["dynamic/kept_groups"], merged["dynamic/draws"]) == (5.0, 2.0)  # groups kept in all; most draws
    assert merged["grad_norm"] == 0.5  # computed from all-reduced gradients: the same everywhere


# metric: (each process's value, the count it is a mean over) -> the merged value, worked by hand.
# Group statistics are over the first draw's prompts; row statistics over the trained completions, which
# dynamic sampling makes a different multiple of the groups on each process.
COUNTS = [{"groups": 2.0, "rows": 6.0}, {"groups": 6.0, "rows": 2.0}]
WEIGHTED = {
    "reward": ((1.0, 0.0), 0.25),  # (1.0 * 2 + 0.0 * 6) / 8 groups
    "reward_std": ((0.4, 0.8), 0.7),
    "frac_reward_zero_std": ((1.0, 0.0), 0.25),
    "advantages/abs_mean": ((0.8, 0.0), 0.2),
    "completions/mean_length": ((4.0, 8.0), 5.0),  # (4 * 6 + 8 * 2) / 8 rows
    "completions/clipped_ratio": ((0.0, 1.0), 0.25),
    "eos_suppressed_frac": ((0.5, 0.1), 0.4),
}


def test_group_and_row_statistics_merge_by_their_own_counts():
    """A process with most of the frozen groups but few trained rows: the deadlock share is that of all
    groups, and each row statistic that of all rows (the boundary rules read clipped_ratio)."""
    per_process = [{key: values[i] for key, (values, _) in WEIGHTED.items()} for i in range(2)]
    merged = merge_process_metrics(per_process, COUNTS)
    assert {key: merged[key] for key in WEIGHTED} == pytest.approx({key: v for key, (_, v) in WEIGHTED.items()})


def test_a_metric_or_count_one_process_lacks_is_merged_over_the_others():
    """A process without a count weighs nothing in its mean; an extreme, a std or a throughput that some
    process lacks stays process 0's; a metric computed everywhere alike is process 0's."""
    per_process = [
        {"reward": 1.0, "step": 7, "completions/max_length": 9.0, "tokens_per_s": 10.0, "step_time": 2.0,
         "rewards/fairness/mean": 0.5, "rewards/fairness/std": 0.1,
         "rewards/hallucination/mean": 0.5, "rewards/hallucination/std": 0.1},
        {"reward": 0.0, "step": 8, "step_time": 4.0, "rewards/fairness/std": 0.9,
         "rewards/hallucination/mean": 0.9, "rewards/hallucination/std": 0.4},
    ]
    counts = [{"groups": 2.0, "rows/fairness": 4.0, "rows/hallucination": 2.0}, {"rows/fairness": 4.0}]
    merged = merge_process_metrics(per_process, counts)
    assert merged["reward"] == 1.0  # process 1 names no groups: weight 0
    assert merged["step"] == 7 and merged["completions/max_length"] == 9.0
    assert merged["rewards/fairness/mean"] == 0.5
    assert merged["rewards/fairness/std"] == pytest.approx(0.1)  # process 1's std has no mean to pool with
    hallucination = (merged["rewards/hallucination/mean"], merged["rewards/hallucination/std"])
    assert hallucination == pytest.approx((0.5, 0.1))  # process 1 counts no hallucination rows
    assert merged["tokens_per_s"] == 10.0 and merged["step_time"] == 4.0


@pytest.mark.parametrize(("metrics", "counts"), [([], []), ([{"reward": 1.0}], []), ([{}], [{}, {}])])
def test_metrics_and_counts_of_other_lengths_are_refused(metrics, counts):
    with pytest.raises(MetricsError, match=f"got {len(metrics)}, {len(counts)}"):
        merge_process_metrics(metrics, counts)
