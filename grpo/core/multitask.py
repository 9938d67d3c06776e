"""Combining the fairness and hallucination gradients (I7).

The rows of the two tasks are disjoint, so each task's gradient comes from its own rows of one
batch. ``combine`` turns per-task flat gradients ``[K, P]`` into one update direction ``[P]``;
``multitask_backward`` computes those gradients from the loss terms and writes the result into
``p.grad``. Every loss it differentiates goes through ``grpo.core.losses.total_loss`` (I7), so the
entropy sign is the same in every mode.
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


class TaskLoss(NamedTuple):
    terms: LossTerms  # the loss terms of one task's rows only


ComputeLosses = Callable[[tuple[str, ...], int], dict[str, TaskLoss]]
"""``compute_losses(subset, micro)``: the forward on micro-batch ``micro`` of the rows of the tasks in
``subset`` -> a ``TaskLoss`` per task that has rows there (already scaled by its share)."""
ReduceFn = Callable[[torch.Tensor], torch.Tensor]
"""Averages a flat per-task gradient ``[P]`` over processes (identity with one process)."""


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


def cagrad(grads: torch.Tensor, c: float, rescale: int,
           inner: Inner = _matmul) -> tuple[torch.Tensor, torch.Tensor]:
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


# --------------------------------------------------------------------------- backward driver


class _TaskGrads(NamedTuple):
    combined: torch.Tensor  # [P] gradient that takes part in the combination
    regulariser: torch.Tensor | None  # [P] KL + entropy gradient added unchanged (reward_only)
    loss: float


def _task_grads(
    params: list[torch.nn.Parameter], task_loss: TaskLoss, beta: float, entropy_coef: float,
    reward_only: bool, retain: bool, space: GradSpace,
) -> _TaskGrads:
    terms = task_loss.terms
    whole = total_loss(terms, beta, entropy_coef)
    if not reward_only:
        return _TaskGrads(space.flat_grad(whole, params, retain), None, float(whole.detach()))
    # The KL/entropy part, written through total_loss with the policy term zeroed (I7: one formula).
    regulariser = total_loss(terms._replace(policy=torch.zeros_like(terms.policy)), beta, entropy_coef)
    policy = space.flat_grad(terms.policy, params, retain=True)
    return _TaskGrads(policy, space.flat_grad(regulariser, params, retain), float(whole.detach()))


def _check_finite(grad: torch.Tensor, what: str, space: GradSpace) -> None:
    if not space.is_finite(grad):
        raise MultitaskError(
            f"multitask_backward: the gradient of {what} holds NaN/Inf; nothing was written into p.grad. "
            "Check that task's rewards, advantages and log-probs, or lower the learning rate"
        )


def _add(into: dict[str, _TaskGrads], task: str, grads: _TaskGrads) -> None:
    """Accumulate one micro-batch's per-task gradients (the combination happens once, afterwards)."""
    if task not in into:
        into[task] = grads
        return
    old = into[task]
    regulariser = None if old.regulariser is None else old.regulariser + grads.regulariser
    into[task] = _TaskGrads(old.combined + grads.combined, regulariser, old.loss + grads.loss)


def _checked(losses: dict[str, TaskLoss], asked: tuple[str, ...]) -> dict[str, TaskLoss]:
    extra = sorted(set(losses) - set(asked))
    if extra:
        raise MultitaskError(f"compute_losses returned tasks {extra} that were not asked for ({asked})")
    return losses


def _gather_task_grads(
    params: list[torch.nn.Parameter],
    compute_losses: ComputeLosses,
    tasks: tuple[str, ...],
    *,
    reward_only: bool,
    low_memory: bool,
    beta: float,
    entropy_coef: float,
    micro_batches: int,
    space: GradSpace,
) -> dict[str, _TaskGrads]:
    """Per-task gradients, summed over micro-batches; per micro-batch one shared graph, or one graph
    per task (low_memory). Each graph is freed before the next one is built."""
    out: dict[str, _TaskGrads] = {}
    for micro in range(micro_batches):
        subsets = [(task,) for task in tasks] if low_memory else [tasks]
        for subset in subsets:
            losses = _checked(compute_losses(subset, micro), subset)
            for task in subset:
                if task in losses:
                    retain = not low_memory and task != subset[-1]
                    _add(out, task, _task_grads(params, losses[task], beta, entropy_coef, reward_only, retain,
                                                space))
            del losses
    return out


def multitask_backward(
    params: list[torch.nn.Parameter],
    compute_losses: ComputeLosses,
    tasks: tuple[str, ...],
    *,
    mode: Mode,
    c: float,
    rescale: int,
    reward_only: bool,
    low_memory: bool,
    beta: float,
    entropy_coef: float,
    reduce_fn: ReduceFn | None = None,
    micro_batches: int = 1,
    task_stats: bool = True,
    space: GradSpace = REPLICATED,
) -> Stats:
    """Combine per-task gradients and ADD the result to ``p.grad`` (like ``backward``; zero_grad first).

    ``compute_losses(subset, micro)`` runs the forward on micro-batch ``micro`` of the rows of
    ``subset`` and returns a TaskLoss for each task of the subset that has rows there (a task with
    none is left out and skipped). Each micro-batch's losses must already be scaled by its share of
    the task's rows (or tokens), so the per-task gradients summed over micro-batches are the
    gradients of the whole batch: gradient accumulation happens BEFORE the nonlinear combination.

    - default: one ``compute_losses(tasks)``; per-task gradients of ``total_loss`` from the shared graph.
    - ``reward_only``: only the policy gradients are combined; the gradient of the tasks' summed
      ``beta * kl - entropy_coef * entropy`` is added unchanged.
    - ``low_memory``: ``compute_losses((task,))`` per task, each graph freed before the next task.
      With ``reward_only`` too, each task takes two gradients (policy, then KL/entropy) from its graph.
    - ``reduce_fn`` (an all-reduce SUM: each process's losses are scaled by their share of the global
      batch, so the sum is the one-process gradient) is applied to each task gradient BEFORE combining:
      the combination is nonlinear, so it must see global gradients. It is then called for every task
      of ``tasks`` (zeros where this process has no rows) so all processes make the same calls.
    - ``space``: whole gradients on every process (default), or under FSDP each process's shard of
      them (``ShardedGradSpace``: FSDP has already summed them over processes, so ``reduce_fn`` must
      be None; dot products and norms are summed over shards, the direction written into the shards).
      Every process must then return a TaskLoss with a graph for every task asked (zero-weighted where
      it has no rows): each backward is a collective.
    - a task whose (reduced) gradient is exactly zero (no rows anywhere, or nothing to learn) is left
      out of the combination: it would only shrink CAGrad's mean and pin its worst-task bound at 0.

    - ``sum`` without ``task_stats``: the sum is linear, so one forward over all rows and ONE
      backward of the summed loss give the same direction; no ``grad_norm/<task>``/``grad_cos``.

    Only parameters with ``requires_grad`` are touched. A NaN/Inf gradient raises MultitaskError
    naming the task before anything is written.
    """
    params = [p for p in params if p.requires_grad]
    if space.sharded and reduce_fn is not None:
        raise MultitaskError("multitask_backward: sharded gradients are already summed over processes; "
                             "pass reduce_fn=None with a sharded GradSpace")
    if mode == "sum" and not task_stats:
        return _summed_backward(params, compute_losses, tasks, beta=beta, entropy_coef=entropy_coef,
                                reduce_fn=reduce_fn, micro_batches=micro_batches, space=space)
    grads = _gather_task_grads(
        params, compute_losses, tasks, reward_only=reward_only, low_memory=low_memory,
        beta=beta, entropy_coef=entropy_coef, micro_batches=micro_batches, space=space,
    )
    zeros = space.zeros(params)  # [P]
    names, rows = [], []
    for task in tasks:
        grad = grads[task].combined if task in grads else None
        if reduce_fn is not None:
            grad = reduce_fn(torch.zeros_like(zeros) if grad is None else grad)
        if grad is None:
            continue
        _check_finite(grad, f"task {task!r}", space)
        if space.any(grad):
            names.append(task)
            rows.append(grad)
    direction, stats = combine(torch.stack(rows), mode, c, rescale, names, space.inner) if rows else (zeros, {})
    if reward_only:
        regulariser = sum((g.regulariser for g in grads.values()), torch.zeros_like(zeros))
        regulariser = reduce_fn(regulariser) if reduce_fn is not None else regulariser
        _check_finite(regulariser, "the KL and entropy terms", space)
        direction = direction + regulariser
    _check_finite(direction, f"the {mode} combination", space)
    space.write(params, direction)
    # Every task reports a gradient norm, 0 when it took no part (no rows or an exactly-zero
    # gradient), so the metric stream keeps its columns; the cosine with a zero vector is reported as 0.
    for task in tasks:
        stats.setdefault(f"grad_norm/{task}", 0.0)
    stats.setdefault("grad_cos", 0.0)
    stats.setdefault("cagrad/weights", [])  # only CAGrad solves for weights
    stats.update({f"loss/{task}": g.loss for task, g in grads.items()})
    stats["multitask/tasks_combined"] = float(len(rows))
    return stats


def _summed_backward(
    params: list[torch.nn.Parameter],
    compute_losses: Callable[[tuple[str, ...], int], dict[str, TaskLoss]],
    tasks: tuple[str, ...],
    *,
    beta: float,
    entropy_coef: float,
    reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None,
    micro_batches: int,
    space: GradSpace,
) -> Stats:
    """``sum`` mode at the cost of one backward: the gradient of the summed task losses, per micro-batch
    one graph over every task's rows. ``reward_only`` changes nothing here: policy plus KL/entropy
    summed over tasks is the whole loss summed over tasks."""
    direction = space.zeros(params)  # [P]
    losses: dict[str, float] = {}
    for micro in range(micro_batches):
        by_task = _checked(compute_losses(tasks, micro), tasks)
        if not by_task:
            continue
        totals = {task: total_loss(loss.terms, beta, entropy_coef) for task, loss in by_task.items()}
        direction += space.flat_grad(sum(totals.values()), params, retain=False)
        for task, value in totals.items():
            losses[task] = losses.get(task, 0.0) + float(value.detach())
        del by_task, totals
    direction = reduce_fn(direction) if reduce_fn is not None else direction
    bad = sorted(task for task, value in losses.items() if not math.isfinite(value)) or sorted(losses)
    _check_finite(direction, f"the summed loss (task(s) {bad})", space)
    space.write(params, direction)
    stats: Stats = {f"loss/{task}": value for task, value in losses.items()}
    stats["multitask/tasks_combined"] = float(len(losses))
    return stats
