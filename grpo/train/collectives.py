"""What the GRPO step asks of the other processes: every all-reduce and gather of a step, in one place.

With one process each function returns its input (no collective is called). With several (``accelerate
launch``, torchrun), each process holds a shard of the step's prompts; these make the per-task
denominators, the batch reward std, a NaN reward, the gradients, the per-task statistics and the step's
metrics those of the global batch, so every process computes the same update and the same monitor decision.
Every process must call them in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from grpo.core.grad_space import GradSpace
from grpo.core.multitask import BatchGradients, TaskGradients, batch_gradients
from grpo.health.process_merge import merge_process_metrics


def several(accelerator: Accelerator) -> bool:
    """Whether other processes take part in the step."""
    return accelerator.num_processes > 1


def sum_tensor(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the processes (on the accelerator's device)."""
    return accelerator.reduce(tensor.to(accelerator.device), "sum") if several(accelerator) else tensor


def replicated(accelerator: Accelerator, space: GradSpace) -> bool:
    """Several processes, each with every weight: each one's gradients are summed with the others' (under
    FSDP, ``space.sharded``, backward has reduce-scattered them already)."""
    return several(accelerator) and not space.sharded


def sum_gradient(accelerator: Accelerator, space: GradSpace, flat: torch.Tensor) -> torch.Tensor:
    """A flat gradient ``[P]`` summed over replicated processes (each loss is scaled by its share of the
    global batch, so the sum is the one-process gradient); ``flat`` itself under FSDP or on one process."""
    return sum_tensor(accelerator, flat) if replicated(accelerator, space) else flat


def sum_task_gradients(
    accelerator: Accelerator,
    space: GradSpace,
    grads: dict[str, TaskGradients],
    tasks: Sequence[str],
    zeros: torch.Tensor,  # [P] a zero gradient (``space.zeros(params)``)
    reward_only: bool,
) -> BatchGradients:
    """This process's task gradients summed over replicated processes BEFORE they are combined (the
    combination is nonlinear): each task of ``tasks`` in order (zeros where this process has none, so
    every process makes the same calls), then the tasks' regularisers together (``reward_only``)."""
    mine = batch_gradients(grads, zeros, reward_only)
    if not replicated(accelerator, space):
        return mine
    summed = {
        task: sum_gradient(accelerator, space, mine.tasks.get(task, torch.zeros_like(zeros))) for task in tasks
    }
    regulariser = None if mine.regulariser is None else sum_gradient(accelerator, space, mine.regulariser)
    return BatchGradients(summed, regulariser)


def global_reward_std(accelerator: Accelerator, rewards: torch.Tensor) -> float:
    """The std of every process's rewards together (from the summed count, sum and sum of squares)."""
    r = rewards.double()
    totals = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()])
    n, total, squares = sum_tensor(accelerator, totals).cpu().tolist()
    variance = (squares - total * total / n) / (n - 1) if n > 1 else 0.0
    return max(variance, 0.0) ** 0.5


def count_anywhere(accelerator: Accelerator, count: float) -> float:
    """``count`` summed over the processes: a NaN reward on one process stops every one of them."""
    if not several(accelerator):
        return count
    return float(sum_tensor(accelerator, torch.tensor([count], device=accelerator.device)))


def sum_task_statistics(
    accelerator: Accelerator, task_stats: dict[str, dict[str, float]], losses: dict[str, float]
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per-task statistics and ``loss/<task>`` summed over processes: each process's values are already
    weighted by its share of the global batch, so the sum is the global one."""
    if not several(accelerator):
        return task_stats, losses
    summed_stats: dict[str, dict[str, float]] = {}
    summed_losses: dict[str, float] = {}
    for stats, loss in gather_object([(task_stats, losses)]):
        for task, values in stats.items():
            acc = summed_stats.setdefault(task, {})
            for key, value in values.items():
                acc[key] = acc.get(key, 0.0) + value
        for key, value in loss.items():
            summed_losses[key] = summed_losses.get(key, 0.0) + value
    return summed_stats, summed_losses


def gather_step(
    accelerator: Accelerator,
    metrics: dict[str, Any],
    counts: dict[str, float],
    raw_texts: Sequence[str],
    prompt_texts: Sequence[str],
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The step's metrics merged over all processes (``merge_process_metrics``) and every process's
    completions and prompt texts, the same on every process; ``counts``: this process's ``groups``,
    ``rows`` and ``rows/<task>``."""
    if not several(accelerator):
        return metrics, list(raw_texts), list(prompt_texts)
    parts = gather_object([(metrics, counts, list(raw_texts), list(prompt_texts))])
    return (
        merge_process_metrics([p[0] for p in parts], [p[1] for p in parts]),
        [text for p in parts for text in p[2]],
        [text for p in parts for text in p[3]],
    )
