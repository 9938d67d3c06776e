"""grpo/train/task_mix.py: which prompts a GRPO step trains on (both tasks, the configured ratio)."""

from __future__ import annotations

import pytest

from grpo.data.select import split_by_task
from grpo.errors import GrpoError
from grpo.train.task_mix import sample_step, shard, shard_indices, task_counts

BY_TASK = {
    "fairness": [{"id": f"f{i}", "task": "fairness"} for i in range(10)],
    "hallucination": [{"id": f"h{i}", "task": "hallucination"} for i in range(10)],
}


@pytest.mark.parametrize(
    ("n_prompts", "fraction", "expected"),
    [
        (8, 0.5, {"fairness": 4, "hallucination": 4}),
        (8, 0.25, {"fairness": 2, "hallucination": 6}),
        (4, 0.01, {"fairness": 1, "hallucination": 3}),  # strictly between 0 and 1: both tasks present
        (4, 0.99, {"fairness": 3, "hallucination": 1}),
        (4, 0.0, {"fairness": 0, "hallucination": 4}),
        (4, 1.0, {"fairness": 4, "hallucination": 0}),
        (1, 0.5, {"fairness": 0, "hallucination": 1}),  # one prompt cannot hold both tasks
    ],
)
def test_task_counts(n_prompts, fraction, expected):
    counts = task_counts(n_prompts, fraction)
    assert counts == expected and sum(counts.values()) == n_prompts


def test_a_step_is_a_pure_function_of_seed_and_step():
    first = sample_step(BY_TASK, 6, 0.5, seed=3, step=5)
    assert sample_step(BY_TASK, 6, 0.5, seed=3, step=5) == first  # what a resumed run sees again
    assert sample_step(BY_TASK, 6, 0.5, seed=3, step=6) != first
    assert sample_step(BY_TASK, 6, 0.5, seed=4, step=5) != first


def test_tasks_are_interleaved():
    picked = sample_step(BY_TASK, 8, 0.5, seed=1, step=1)
    assert [r["task"] for r in picked] == ["fairness", "hallucination"] * 4
    assert all(r in BY_TASK[r["task"]] for r in picked)


def test_uneven_ratio_appends_the_rest_of_the_larger_task():
    picked = sample_step(BY_TASK, 6, 1 / 3, seed=2, step=1)
    assert [r["task"] for r in picked] == ["fairness", "hallucination", "fairness", "hallucination",
                                            "hallucination", "hallucination"]


def test_a_missing_task_is_an_error_naming_the_task_and_the_fix():
    only_fairness = split_by_task(BY_TASK["fairness"])
    with pytest.raises(GrpoError, match=r"no 'hallucination' records.*fairness_fraction"):
        sample_step(only_fairness, 4, 0.5, seed=0, step=1)
    assert len(sample_step(only_fairness, 4, 1.0, seed=0, step=1)) == 4  # fraction 1 needs none



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
    with pytest.raises(GrpoError, match="process 2 of 2 does not exist"):
        shard_indices(["fairness", "hallucination"], 2, 2)


KINDED = {
    "fairness": [{"id": f"f{i}", "task": "fairness", "context_condition": "ambig" if i < 9 else "disambig"}
                 for i in range(10)],
    "hallucination": [{"id": f"h{i}", "task": "hallucination", "answerable": i < 2} for i in range(10)],
}


@pytest.mark.parametrize(("share", "answered"), [(0.5, 2), (0.25, 1), (0.0, 0), (1.0, 4)])
def test_kind_share_sets_each_tasks_answered_items_whatever_the_pool(share, answered):
    """The pools hold 1 disambiguated fairness item in 10 and 2 answerable grounded ones in 10; with
    ``grpo.kind_share`` every step holds the asked share of each task's prompts anyway."""
    for step in range(1, 6):
        picked = sample_step(KINDED, 8, 0.5, seed=1, step=step, kind_share=share)
        fair = [r for r in picked if r["task"] == "fairness"]
        grounded = [r for r in picked if r["task"] == "hallucination"]
        assert sum(r["context_condition"] == "disambig" for r in fair) == answered
        assert sum(r["answerable"] for r in grounded) == answered
    assert sample_step(KINDED, 8, 0.5, seed=1, step=3, kind_share=share) == sample_step(
        KINDED, 8, 0.5, seed=1, step=3, kind_share=share
    )


def test_kind_share_shuffles_the_kinds_within_each_task():
    """The kinds of a task's prompts come in no fixed order: the first prompt of a step is of the kind whose
    context answers on some steps and of the other kind on others (micro-batches, process shards and
    resampling's cut all take prompts by position)."""
    first_kinds = set()
    for step in range(1, 21):
        fair = [r for r in sample_step(KINDED, 8, 0.5, seed=1, step=step, kind_share=0.5) if r["task"] == "fairness"]
        first_kinds.add(fair[0]["context_condition"])
    assert first_kinds == {"ambig", "disambig"}


def test_kind_share_null_draws_as_before_and_a_missing_kind_is_an_error():
    assert sample_step(BY_TASK, 6, 0.5, seed=3, step=5, kind_share=None) == sample_step(BY_TASK, 6, 0.5, seed=3, step=5)
    only_ambiguous = {**KINDED, "fairness": KINDED["fairness"][:9]}
    with pytest.raises(GrpoError, match="no disambiguated fairness records but grpo.kind_share=0.5"):
        sample_step(only_ambiguous, 8, 0.5, seed=1, step=1, kind_share=0.5)


@pytest.mark.parametrize(("n", "share", "expected"), [(8, 0.7, (6, 2)), (10, 0.66, (7, 3)), (5, 0.5, (2, 3)),
                                                   (2, 0.9, (1, 1)), (2, 0.1, (1, 1)), (1, 0.5, (0, 1))])
def test_split_count_rounds_to_the_nearest_count(n, share, expected):
    """8 * 0.7 = 5.6 prompts is 6, not 5 (a truncation would skew every ratio towards the second task); a
    half rounds to even, as Python's ``round``. Two items strictly shared give one to each side; one item
    cannot be split."""
    from grpo.train.task_mix import split_count

    assert split_count(n, share) == expected


def test_as_many_processes_as_prompts_give_each_process_one_prompt():
    shards = [shard_indices(list("fhfh"), p, 4) for p in range(4)]
    assert shards == [[0], [2], [1], [3]]
