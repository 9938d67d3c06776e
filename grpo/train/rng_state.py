"""Random states of a run: captured with a checkpoint, restored on resume (python, numpy, torch CPU and
CUDA, and the run's named generators), and their tensors kept apart from the JSON they are saved in."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from grpo.errors import GrpoError


class RngStateError(GrpoError, ValueError):
    """A saved random state that does not hold what the run asks to restore."""


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every random state a run uses: python, numpy, torch CPU, torch CUDA, and named generators."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            **numpy_state,
            "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()},
        },
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "generators": {name: gen.get_state() for name, gen in (generators or {}).items()},
    }


def restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Put back what ``capture_rng`` captured; every named generator must be in the saved state."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    key = np.asarray(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    saved = state["generators"]
    for name, gen in (generators or {}).items():
        if name not in saved:
            raise RngStateError(
                f"checkpoint RNG state has no generator {name!r} (saved: {sorted(saved)}): pass the same "
                "generator names to capture_rng when saving and to restore_rng when resuming"
            )
        gen.set_state(saved[name])


def split_tensors(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able copy of ``tree`` whose tensors are moved into ``tensors`` (a placeholder stays)."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(tree, dict):
        return {key: split_tensors(value, f"{prefix}.{key}", tensors) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [split_tensors(value, f"{prefix}.{i}", tensors) for i, value in enumerate(tree)]
    return tree


def join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each placeholder of ``split_tensors`` replaced by its tensor."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        return {key: join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(value, tensors) for value in tree]
    return tree
