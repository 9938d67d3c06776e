"""Where a process's flat gradients live: whole on every process, or a shard of them (FSDP2).

The GRPO update (``grpo.train.update``, ``grpo.core.multitask``) works on flat per-task gradients ``[P]``. Without sharding ``P`` is every
trainable weight and each process takes ``torch.autograd.grad``; under FSDP2 (``fully_shard``) the
parameters are ``DTensor`` shards, the gradient is taken by ``backward`` (FSDP reduce-scatters it
into each parameter's ``.grad``, summed over processes), and ``P`` is this process's shard only. Every
quantity the combination needs that spans the whole gradient (dot products, norms, "is it finite",
"is it zero") is then a local partial result summed over the processes by ``total``; the combined
direction is written back into the local shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor


class GradSpace:
    """Whole gradients on every process (one process, or replicated data parallelism)."""

    sharded = False

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's part of a parameter or of its gradient."""
        return tensor

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        """A sum over the whole gradient from this process's partial sum (identity: it is whole here)."""
        return partial

    def zeros(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """A zero flat gradient ``[P]`` (fp32) on the parameters' device."""
        return torch.cat([torch.zeros(self.local(p).numel(), device=p.device) for p in params])

    def flat_grad(self, loss: torch.Tensor, params: list[torch.nn.Parameter], retain: bool) -> torch.Tensor:
        """d loss / d params as one fp32 vector [P]; parameters the loss does not reach get 0."""
        if not loss.requires_grad:
            return self.zeros(params)
        grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
        return torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1).float()
                for g, p in zip(grads, params, strict=True)
            ]
        )

    def write(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """Add slices of ``flat`` [P] to each parameter's ``.grad`` (created when absent)."""
        offset = 0
        for p in params:
            shape = self.local(p).shape
            piece = flat[offset : offset + shape.numel()].view(shape).to(p.dtype)
            offset += shape.numel()
            if p.grad is None:
                p.grad = self._as_grad(p, piece.clone())
            else:
                self.local(p.grad).add_(piece)

    def _as_grad(self, param: torch.nn.Parameter, piece: torch.Tensor) -> torch.Tensor:
        return piece

    def inner(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b.T`` over the whole gradient: a [K, P], b [M, P] -> [K, M]."""
        return self.total(a @ b.T)

    def is_finite(self, flat: torch.Tensor) -> bool:
        """Whether the whole gradient holds no NaN/Inf (the same answer on every process)."""
        return float(self.total((~torch.isfinite(flat)).sum().float().reshape(1))) == 0.0

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Scale the gradients so their global L2 norm is at most ``max_norm``; return the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def any(self, flat: torch.Tensor) -> bool:
        """Whether any element of the whole gradient is nonzero (the same answer on every process)."""
        return float(self.total(flat.ne(0).any().float().reshape(1))) > 0.0


REPLICATED = GradSpace()


class ShardedGradSpace(GradSpace):
    """FSDP2: each process holds a shard of every gradient; ``all_reduce`` sums a tensor over the
    processes (the model must reduce-scatter by SUM, ``grpo.train.sharding.shard_model``)."""

    sharded = True

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.all_reduce = all_reduce

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(partial)

    def flat_grad(self, loss: torch.Tensor, params: list[torch.nn.Parameter], retain: bool) -> torch.Tensor:
        """This process's shard of d loss / d params [P_local]. ``backward`` (not ``autograd.grad``):
        FSDP2 computes with gathered weights that are not the sharded leaves, and reduce-scatters in
        its post-backward hooks. Every process must call it for the same losses in the same order."""
        if not loss.requires_grad:
            return self.zeros(params)
        loss.backward(retain_graph=retain)
        flat = torch.cat(
            [
                (
                    torch.zeros(self.local(p).numel(), device=p.device)
                    if p.grad is None
                    else self.local(p.grad).reshape(-1).float()
                )
                for p in params
            ]
        )
        for p in params:
            p.grad = None
        return flat

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """``clip_grad_norm_``'s rule on the norm of the whole gradient: the local shards' squares summed
        over processes, then every shard scaled by the same coefficient."""
        grads = [self.local(p.grad) for p in params if p.grad is not None]
        local = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=params[0].device))
        norm = float(self.total(local.reshape(1)).sqrt())
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)
        return norm

    def _as_grad(self, param: torch.nn.Parameter, piece: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return piece
        return DTensor.from_local(
            piece,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
