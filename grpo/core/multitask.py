"""Combining the fairness and hallucination gradients (I7).

The rows of the two tasks are disjoint, so each task's gradient comes from its own rows of one
batch. ``task_gradient`` takes a task's flat gradient ``[P]`` from its loss terms, ``accumulate`` sums
it over micro-batches, and ``combine_task_gradients`` turns every task's gradient into one update
direction ``[P]`` (``combine``: sum, PCGrad or CAGrad). Every loss differentiated here goes through
``grpo.core.losses.total_loss`` (I7), so the entropy sign is the same in every mode. The GRPO step
(``grpo/train/update.py``) runs the forwards and calls these in order. Everything here computes on the
gradients of the whole batch: what several processes exchange is the train layer's
(``grpo/train/collectives.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch

from grpo.core.grad_space import REPLICATED, GradSpace
from grpo.core.losses import LossTerms, total_loss
from grpo.errors import GrpoError

Mode = Literal["sum", "pcgrad", "cagrad"]
MODES = ("sum", "pcgrad", "cagrad")
Stats = dict[str, float | list[float]]
Inner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``inner(a [K, P], b [M, P]) -> [K, M]``: dot products over the WHOLE gradient (under sharding, the
local partial products summed over processes; ``grpo/core/grad_space.py``)."""


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b.T


class MultitaskError(GrpoError, ValueError):
    """A per-task gradient is not finite or the inputs do not fit; the message names the task and fix."""


# --------------------------------------------------------------------------- pure combinations


def pcgrad(grads: torch.Tensor, inner: Inner = _matmul) -> torch.Tensor:
    """PCGrad (Yu et al., arXiv 2001.06782): grads [K, P] -> sum of projected gradients [P].

    Each task's gradient is projected onto the normal plane of every other task's ORIGINAL
    gradient it conflicts with (negative dot product), in the fixed order 0..K-1 instead of the
    paper's random shuffle, so a step is reproducible.
    """
    projected = grads.clone()  # [K, P]
    sq_norms = inner(grads, grads).diagonal()  # [K]
    for i in range(grads.shape[0]):
        for j in range(grads.shape[0]):
            if i == j or sq_norms[j] == 0:
                continue
            dot = inner(projected[i : i + 1], grads[j : j + 1])[0, 0]
            if dot < 0:
                projected[i] -= (dot / sq_norms[j]) * grads[j]
    return projected.sum(dim=0)


def _project_to_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of v [K] onto {w >= 0, sum w = 1} (Duchi et al. 2008)."""
    u = torch.sort(v, descending=True).values
    css = u.cumsum(0) - 1.0
    k = torch.arange(1, v.shape[0] + 1, dtype=v.dtype)
    active = u - css / k > 0
    rho = int(active.nonzero().max())
    return (v - css[rho] / (rho + 1)).clamp(min=0.0)


def _cagrad_weights(gram: torch.Tensor, c: float, iters: int = 300) -> torch.Tensor:
    """Minimise the CAGrad dual ``F(w) = w.G.b + c ||g0|| sqrt(w.G.w)`` over the simplex -> w [K].

    gram: [K, K] fp64 Gram matrix of the task gradients, b = 1/K. F is convex, so projected
    gradient descent with a backtracking step converges; the problem is K x K, not P-sized.
    """
    k = gram.shape[0]
    b = torch.full((k,), 1.0 / k, dtype=torch.float64)
    scale = gram.diagonal().mean()
    if scale <= 0:
        return b
    g = gram / scale  # F(w) scales by a constant: same minimiser, well-conditioned numbers
    gb = g @ b
    radius = c * math.sqrt(max(float(b @ gb), 0.0))

    def objective(w: torch.Tensor) -> float:
        return float(w @ gb) + radius * math.sqrt(max(float(w @ g @ w), 0.0))

    w, step = b.clone(), 1.0
    for _ in range(iters):
        norm = math.sqrt(max(float(w @ g @ w), 0.0))
        grad = gb + (radius / norm) * (g @ w) if norm > 1e-12 else gb
        f_w = objective(w)
        while True:
            candidate = _project_to_simplex(w - step * grad)
            move = candidate - w
            if objective(candidate) <= f_w + float(grad @ move) + float(move @ move) / (2 * step) + 1e-15:
                break
            step *= 0.5
            if step < 1e-12:
                return w
        if objective(candidate) > f_w - 1e-13 * max(1.0, abs(f_w)):
            return candidate  # no progress beyond float noise: converged
        w, step = candidate, step * 2.0
    return w


def cagrad(
    grads: torch.Tensor, c: float, rescale: int, inner: Inner = _matmul
) -> tuple[torch.Tensor, torch.Tensor]:
    """CAGrad (Liu et al., arXiv 2110.14048): grads [K, P] -> (d [P], weights [K]).

    ``d = g0 + sqrt(phi) / ||g_w|| * g_w`` with g0 the MEAN gradient, ``phi = c^2 ||g0||^2`` and
    w the dual solution: d maximises the worst task's improvement ``min_i g_i.d`` within distance
    ``c ||g0||`` of g0. ``c = 0`` gives g0; ``c >= 1`` guarantees ``g_i.d >= 0`` for every task (d = 0
    lies in the ball). ``rescale``: 0 d, 1 d / (1 + c^2), 2 d / (1 + c).
    """
    if rescale not in (0, 1, 2):
        raise MultitaskError(f"grpo.multitask.cagrad_rescale must be 0, 1 or 2 (got {rescale})")
    gram = inner(grads, grads).double().cpu()  # [K, K]: the dual is solved on the CPU, it is tiny
    weights = _cagrad_weights(gram, c)
    k = grads.shape[0]
    b = torch.full((k,), 1.0 / k, dtype=torch.float64)
    g0_norm = math.sqrt(max(float(b @ gram @ b), 0.0))
    gw_norm = math.sqrt(max(float(weights @ gram @ weights), 0.0))
    d = grads.mean(dim=0)  # [P] g0
    if gw_norm > 0:
        gw = weights.to(device=grads.device, dtype=grads.dtype) @ grads  # [P]
        d = d + (c * g0_norm / gw_norm) * gw
    divisor = (1.0, 1.0 + c**2, 1.0 + c)[rescale]
    return d / divisor, weights.float()


def combine(
    grads: torch.Tensor,  # [K, P] one flat gradient per task
    mode: Mode,
    c: float = 0.5,
    rescale: int = 1,
    names: Sequence[str] | None = None,
    inner: Inner = _matmul,
) -> tuple[torch.Tensor, Stats]:
    """One update direction [P] from K task gradients, and statistics.

    ``sum`` returns the SUM of the gradients (the gradient of the summed task losses); ``pcgrad``
    the sum of projected gradients; ``cagrad`` a direction around the MEAN gradient (so its scale is
    about 1/K of ``sum``'s). Stats: ``grad_norm/<name>``, ``grad_cos`` (for K >= 2: the smallest
    pairwise cosine, i.e. the cosine of the two task gradients when K = 2), ``cagrad/weights``;
    they describe the gradients given (the policy gradients only, under ``reward_only``).
    ``inner``: how dot products are taken (summed over shards under FSDP); every norm and cosine
    comes from one Gram matrix ``inner(grads, grads)``.
    """
    if mode not in MODES:
        raise MultitaskError(f"grpo.multitask.mode must be one of {MODES} (got {mode!r})")
    names = [str(i) for i in range(grads.shape[0])] if names is None else list(names)
    gram = inner(grads, grads)  # [K, K]
    norms = gram.diagonal().clamp(min=0.0).sqrt()  # [K]
    stats: Stats = {f"grad_norm/{name}": float(norm) for name, norm in zip(names, norms, strict=True)}
    if grads.shape[0] >= 2:
        scale = norms.clamp(min=1e-30)
        cos = gram / scale.unsqueeze(-1) / scale.unsqueeze(0)  # [K, K]
        off_diagonal = ~torch.eye(grads.shape[0], dtype=torch.bool, device=grads.device)
        stats["grad_cos"] = float(cos[off_diagonal].min())
    if mode == "sum":
        return grads.sum(dim=0), stats
    if mode == "pcgrad":
        return pcgrad(grads, inner), stats
    d, weights = cagrad(grads, c, rescale, inner)
    stats["cagrad/weights"] = [float(w) for w in weights]
    return d, stats


# --------------------------------------------------------------------------- per-task gradients


class TaskGradients(NamedTuple):
    """One task's flat gradients ``[P]`` (summed over the micro-batches seen so far)."""

    combined: torch.Tensor  # [P] the gradient that takes part in the combination
    regulariser: torch.Tensor | None  # [P] KL + entropy gradient added unchanged (reward_only), else None
    loss: float  # the task's total loss (policy + beta * kl - entropy_coef * entropy)


def task_gradient(
    params: list[torch.nn.Parameter],
    terms: LossTerms,
    beta: float,
    entropy_coef: float,
    reward_only: bool,
    retain: bool,
    space: GradSpace = REPLICATED,
) -> TaskGradients:
    """d total_loss / d params of one task's loss terms (I7: through ``total_loss``). ``reward_only``:
    the policy term's gradient apart from the KL/entropy part's (``total_loss`` with the policy term
    zeroed: one formula). ``retain`` keeps the graph for another task's gradient through it."""
    whole = total_loss(terms, beta, entropy_coef)
    if not reward_only:
        return TaskGradients(space.flat_grad(whole, params, retain), None, float(whole.detach()))
    regulariser = total_loss(terms._replace(policy=torch.zeros_like(terms.policy)), beta, entropy_coef)
    policy = space.flat_grad(terms.policy, params, retain=True)
    return TaskGradients(policy, space.flat_grad(regulariser, params, retain), float(whole.detach()))


def accumulate(into: dict[str, TaskGradients], task: str, grads: TaskGradients) -> None:
    """Add one micro-batch's gradients of ``task`` (the combination happens once, afterwards)."""
    if task not in into:
        into[task] = grads
        return
    old = into[task]
    regulariser = None if old.regulariser is None else old.regulariser + grads.regulariser
    into[task] = TaskGradients(old.combined + grads.combined, regulariser, old.loss + grads.loss)


def check_finite(grad: torch.Tensor, what: str, space: GradSpace = REPLICATED) -> None:
    """MultitaskError naming ``what`` when the whole gradient holds NaN/Inf."""
    if not space.is_finite(grad):
        raise MultitaskError(
            f"the gradient of {what} holds NaN/Inf; nothing was written into p.grad. "
            "Check that task's rewards, advantages and log-probs, or lower the learning rate"
        )


class BatchGradients(NamedTuple):
    """What the combination takes, over the whole batch: with several replicated processes, each process's
    share summed over them first (``grpo.train.collectives.sum_task_gradients``: the combination is nonlinear)."""

    tasks: dict[str, torch.Tensor]  # task -> its gradient [P] (``TaskGradients.combined``); only tasks with one
    regulariser: torch.Tensor | None  # [P] every task's KL + entropy gradient summed (``reward_only``), else None


def batch_gradients(grads: dict[str, TaskGradients], zeros: torch.Tensor, reward_only: bool) -> BatchGradients:
    """The tasks' gradients as the combination takes them (``zeros``: [P], the regulariser's start)."""
    regulariser = sum((g.regulariser for g in grads.values()), torch.zeros_like(zeros)) if reward_only else None
    return BatchGradients({task: g.combined for task, g in grads.items()}, regulariser)


def combine_task_gradients(
    grads: BatchGradients,
    tasks: Sequence[str],
    zeros: torch.Tensor,  # [P] a zero gradient (``space.zeros(params)``)
    *,
    mode: Mode,
    c: float,
    rescale: int,
    space: GradSpace = REPLICATED,
) -> tuple[torch.Tensor, Stats]:
    """The update direction ``[P]`` from every task's gradient over the whole batch, and the statistics.

    - a task without a gradient, or whose gradient is exactly zero (no rows anywhere, or nothing to
      learn), is left out of the combination: it would only shrink CAGrad's mean and pin its worst-task
      bound at 0.
    - ``grads.regulariser`` (``reward_only``): the tasks' KL/entropy gradients, added to the combined
      direction unchanged.

    A NaN/Inf gradient raises MultitaskError naming the task.
    """
    rows = _taking_part(grads.tasks, tasks, space)
    direction, stats = (
        combine(torch.stack(list(rows.values())), mode, c, rescale, list(rows), space.inner)
        if rows
        else (zeros, {})
    )
    if grads.regulariser is not None:
        check_finite(grads.regulariser, "the KL and entropy terms", space)
        direction = direction + grads.regulariser
    check_finite(direction, f"the {mode} combination", space)
    # Every task reports a gradient norm, 0 when it took no part (no rows or an exactly-zero
    # gradient), so the metric stream keeps its columns; the cosine with a zero vector is reported as 0.
    for task in tasks:
        stats.setdefault(f"grad_norm/{task}", 0.0)
    stats.setdefault("grad_cos", 0.0)
    stats.setdefault("cagrad/weights", [])  # only CAGrad solves for weights
    stats["multitask/tasks_combined"] = float(len(rows))
    return direction, stats


def _taking_part(
    grads: dict[str, torch.Tensor], tasks: Sequence[str], space: GradSpace
) -> dict[str, torch.Tensor]:
    """Task -> its gradient ``[P]``, for the tasks of ``tasks`` whose gradient is not exactly zero, in
    ``tasks``' order; MultitaskError on a NaN/Inf one."""
    rows = {}
    for task in tasks:
        if task not in grads:
            continue
        check_finite(grads[task], f"task {task!r}", space)
        if space.any(grads[task]):
            rows[task] = grads[task]
    return rows
