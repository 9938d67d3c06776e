"""Tests of grpo/train/collectives.py's gradient sums: what replicated processes exchange before the per-task
combination (``core.multitask.combine_task_gradients`` computes on the sums, it exchanges nothing). Two
processes run end to end in tests/test_distributed.py (slow); here a stand-in accelerator adds the other
process's tensors, call by call."""

from __future__ import annotations

import pytest
import torch

from grpo.core.grad_space import REPLICATED, ShardedGradSpace
from grpo.core.multitask import TaskGradients, combine, combine_task_gradients
from grpo.train import collectives

TASKS = ("fairness", "hallucination")


class TwoProcesses:
    """Accelerate on two processes, as ``collectives`` uses it: ``reduce`` adds the other process's tensor of
    the same call (``other``, in call order) and records what this process sent."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other: list[torch.Tensor]) -> None:
        self.other, self.sent = list(other), []

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        self.sent.append(tensor.clone())
        return tensor + self.other.pop(0)


def grads(*pairs: tuple[str, list[float], list[float] | None]) -> dict[str, TaskGradients]:
    return {
        task: TaskGradients(torch.tensor(g), None if r is None else torch.tensor(r), 1.0) for task, g, r in pairs
    }


def test_each_task_gradient_is_summed_over_the_processes_before_the_combination():
    mine = grads(("fairness", [1.0, 0.0, 2.0], None), ("hallucination", [-1.0, 1.0, 0.0], None))
    theirs = [torch.tensor([0.5, 3.0, -1.0]), torch.tensor([-2.0, 0.0, 1.0])]
    accelerator, zeros = TwoProcesses(theirs), torch.zeros(3)
    summed = collectives.sum_task_gradients(accelerator, REPLICATED, mine, TASKS, zeros, reward_only=False)
    assert [t.tolist() for t in accelerator.sent] == [[1.0, 0.0, 2.0], [-1.0, 1.0, 0.0]]  # in TASKS order
    direction, _ = combine_task_gradients(summed, TASKS, zeros, mode="cagrad", c=0.5, rescale=1)
    whole = torch.stack([mine[t].combined + other for t, other in zip(TASKS, theirs, strict=True)])
    torch.testing.assert_close(direction, combine(whole, "cagrad", c=0.5, rescale=1)[0])
    # Not what combining each process's gradients and summing the directions gives: the rule is nonlinear.
    apart = combine(torch.stack([mine[t].combined for t in TASKS]), "cagrad")[0] + combine(torch.stack(theirs), "cagrad")[0]
    assert not torch.allclose(direction, apart, atol=1e-3)


def test_a_task_this_process_lacks_is_summed_as_zeros_and_the_regularisers_once_after():
    """Every process makes the same calls whatever rows it holds, or the all-reduces would pair wrongly."""
    mine = grads(("hallucination", [1.0, 2.0], [0.5, 0.5]))
    theirs = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    accelerator = TwoProcesses(theirs)
    summed = collectives.sum_task_gradients(accelerator, REPLICATED, mine, TASKS, torch.zeros(2), reward_only=True)
    assert [t.tolist() for t in accelerator.sent] == [[0.0, 0.0], [1.0, 2.0], [0.5, 0.5]]
    assert {t: g.tolist() for t, g in summed.tasks.items()} == {"fairness": [3.0, 0.0], "hallucination": [1.0, 3.0]}
    assert summed.regulariser.tolist() == [1.5, 1.5]


@pytest.mark.parametrize("case", ["one process", "fsdp"])
def test_nothing_is_exchanged_on_one_process_or_under_fsdp(case):
    """Under FSDP backward has reduce-scattered the gradients already: summing again would double them."""
    accelerator = TwoProcesses([])
    if case == "one process":
        accelerator.num_processes = 1
    space = REPLICATED if case == "one process" else ShardedGradSpace(lambda t: t)
    mine = grads(("fairness", [1.0, 2.0], [0.25, 0.0]), ("hallucination", [0.0, 1.0], [0.0, 0.5]))
    summed = collectives.sum_task_gradients(accelerator, space, mine, TASKS, torch.zeros(2), reward_only=True)
    assert accelerator.sent == []
    assert {t: g.tolist() for t, g in summed.tasks.items()} == {"fairness": [1.0, 2.0], "hallucination": [0.0, 1.0]}
    assert summed.regulariser.tolist() == [0.25, 0.5]
    assert collectives.sum_gradient(accelerator, space, torch.ones(2)).tolist() == [1.0, 1.0]


def test_counts_and_the_reward_std_are_those_of_every_processs_rows():
    """A NaN count on the other process reaches this one; the batch std is the sample std of all rewards."""
    assert collectives.count_anywhere(TwoProcesses([torch.tensor([2.0])]), 0.0) == 2.0
    other = torch.tensor([2.0, 3.0 + 4.0, 9.0 + 16.0], dtype=torch.float64)  # count, sum, sum of squares of [3, 4]
    std = collectives.global_reward_std(TwoProcesses([other]), torch.tensor([1.0, 2.0]))
    assert std == pytest.approx(float(torch.tensor([1.0, 2.0, 3.0, 4.0]).std()))  # Bessel's correction, n - 1
    equal = torch.full((3,), 0.1, dtype=torch.float64)  # sums whose variance rounds just below 0
    totals = torch.stack([torch.tensor(3.0, dtype=torch.float64), equal.sum(), (equal * equal).sum()])
    assert collectives.global_reward_std(TwoProcesses([totals]), equal) == 0.0
    nothing = torch.zeros(3, dtype=torch.float64)  # the other process holds no rewards
    assert collectives.global_reward_std(TwoProcesses([nothing]), torch.tensor([5.0])) == 0.0, "one reward in all"


def test_a_steps_metrics_completions_and_prompts_are_every_processs(monkeypatch):
    """On several processes each process gets the merged metrics and every process's completions with their
    prompts, in the same process order (the monitor and the logs read the global batch)."""
    from grpo.health.process_merge import merge_process_metrics

    parts = [({"reward": 1.0}, {"groups": 1.0, "rows": 2.0}, ["a1", "a2"], ["p1", "p1"]),
             ({"reward": 0.0}, {"groups": 1.0, "rows": 6.0}, ["b1", "b2"], ["p2", "p2"])]
    monkeypatch.setattr(collectives, "gather_object", lambda mine: parts)
    metrics, texts, prompts = collectives.gather_step(TwoProcesses([]), *parts[0])
    assert texts == ["a1", "a2", "b1", "b2"] and prompts == ["p1", "p1", "p2", "p2"]
    assert metrics == merge_process_metrics([p[0] for p in parts], [p[1] for p in parts])
    assert metrics["reward"] == pytest.approx(0.5)  # not this process's own 1.0


def test_task_statistics_and_losses_are_summed_over_the_processes(monkeypatch):
    mine = ({"fairness": {"entropy": 0.25, "kl": 0.5}}, {"loss/fairness": 1.0})
    theirs = ({"fairness": {"entropy": 0.5, "kl": 0.25}, "hallucination": {"entropy": 0.5}}, {"loss/fairness": 2.0})
    monkeypatch.setattr(collectives, "gather_object", lambda objects: [*objects, theirs])
    stats, losses = collectives.sum_task_statistics(TwoProcesses([]), *mine)
    assert stats == {"fairness": {"entropy": 0.75, "kl": 0.75}, "hallucination": {"entropy": 0.5}}
    assert losses == {"loss/fairness": 3.0}
