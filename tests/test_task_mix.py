"""grpo/train/task_mix.py: every process's shard holds its share of each task."""

from __future__ import annotations

import pytest

from grpo.errors import GrpoError
from grpo.train.task_mix import sample_step, shard, shard_indices


@pytest.mark.parametrize(("tasks", "processes", "expected"), [
    ("fhfhfhfh", 2, ["fhfh", "fhfh"]),  # a plain stride gives ffff / hhhh
    ("fhfhfh", 2, ["fhf", "hfh"]),
    ("fhfhfhff", 2, ["fhff", "hfhf"]),  # fairness_fraction 0.625: 3+1 and 2+2
    ("fhfhff", 4, ["fh", "fh", "f", "f"]),
])
def test_every_process_holds_its_share_of_each_task(tasks, processes, expected):
    shards = [shard_indices(list(tasks), p, processes) for p in range(processes)]
    assert ["".join(tasks[i] for i in s) for s in shards] == expected
    assert sorted(i for s in shards for i in s) == list(range(len(tasks)))  # a partition, in order
    for task in set(tasks):
        counts = [sum(tasks[i] == task for i in s) for s in shards]
        assert max(counts) - min(counts) <= 1


def test_shard_of_a_sampled_step_keeps_both_tasks():
    by_task = {"fairness": [{"task": "fairness", "id": i} for i in range(5)],
               "hallucination": [{"task": "hallucination", "id": i} for i in range(5)]}
    records = sample_step(by_task, 8, 0.5, seed=0, step=1)
    for process in range(2):
        assert {r["task"] for r in shard(records, process, 2)} == {"fairness", "hallucination"}


def test_more_processes_than_prompts_is_an_error_naming_the_param():
    with pytest.raises(GrpoError, match=r"grpo.prompts_per_step >= 4"):
        shard_indices(["fairness", "hallucination"], 0, 4)
