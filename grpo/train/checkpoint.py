"""Atomic checkpoints: a reader never sees half a checkpoint, and resume is bit-exact on CPU.

A checkpoint is written into ``run_dir/.tmp-step-XXXXXXXX-<random>`` and renamed to
``run_dir/checkpoint-XXXXXXXX`` only once complete. Its last file, ``state.json``, is the completion
marker: it holds the step and a manifest (size and sha256 of every other file), so a directory left
by a kill, a full disk or bit rot is recognisably incomplete and ``latest_checkpoint`` skips it.

Contents (no pickle anywhere, DESIGN.md "Reliability"):

- ``model.safetensors``: the trainable parameters (a LoRA adapter, or every weight for a full fine-tune);
- ``optimizer.pt`` / ``scheduler.pt``: state dicts, read back with ``torch.load(weights_only=True)``;
- ``rng.json`` + ``rng.safetensors``: python, numpy, torch CPU/CUDA and named ``torch.Generator`` states;
- ``history.json``: the per-step metric dicts so far; ``lineage.json``: what produced the run.

Several processes: the main process writes, every process loads the same files. Weights and optimizer
state are always whole tensors under their unsharded names and indices: with FSDP2 they are gathered
from the shards before the save (``full_state``, a collective) and cut into this process's shard at
load, so a checkpoint loads on any number of processes, sharded or not.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grpo.errors import GrpoError
from grpo.files import file_sha256, write_json
from grpo.train.rng_state import join_tensors, split_tensors
from grpo.train.sharding import full_tensor, local_part, shard_like

FORMAT_VERSION = 1
MARKER = "state.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG_JSON = "rng.json"
RNG_TENSORS = "rng.safetensors"
HISTORY = "history.json"
LINEAGE = "lineage.json"
TMP_PREFIX = ".tmp-step-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d{8,})$")


class CheckpointError(GrpoError):
    """A checkpoint is incomplete, corrupt or does not fit the model it is loaded into."""


class FullState(NamedTuple):
    """Whole tensors of what trains, as a checkpoint holds them."""

    weights: dict[str, torch.Tensor]
    """``trainable_state``: name -> CPU tensor."""
    optimizer: dict[str, Any] | None
    """``optimizer.state_dict()`` with whole CPU tensors; None without an optimizer."""


class Restored(NamedTuple):
    """What ``load_checkpoint`` gives back besides the in-place model/optimizer/scheduler state."""

    step: int
    """The optimizer step the checkpoint was taken after."""
    rng: dict[str, Any]
    """Random states, as ``capture_rng`` returned them; apply with ``restore_rng``."""
    history: list[dict[str, Any]]
    """Per-step metric dicts up to ``step``."""
    lineage: dict[str, Any]
    """The lineage record saved with the checkpoint."""


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """``run_dir/checkpoint-XXXXXXXX`` (zero-padded, so names sort by step)."""
    return Path(run_dir) / f"checkpoint-{step:08d}"


# --------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _number(value: Any) -> Any:
    """JSON fallback for metric values that are still tensors or numpy numbers; others are an error."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"checkpoint: a value of type {type(value).__name__} cannot be written as JSON")


def _write_json(path: Path, value: Any) -> None:
    write_json(path, value, indent=1, default=_number)


def _step_of(path: Path) -> int | None:
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


# --------------------------------------------------------------------------- weights


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of the parameters that train (the adapter for a peft model, all for full FT).

    ``named_parameters`` lists a tied weight once (Llama's ``lm_head`` shares ``embed_tokens``), so
    safetensors never sees two names for one storage.
    """
    state = {
        name: full_tensor(param.detach()).cpu().contiguous()
        for name, param in model.named_parameters()
        if param.requires_grad
    }
    if not state:
        raise CheckpointError(
            f"{type(model).__name__} has no trainable parameter to checkpoint: unfreeze the weights "
            "(full fine-tune) or wrap the model with a LoRA adapter before training"
        )
    return state


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> FullState:
    """Trainable weights and optimizer state as whole CPU tensors. Under FSDP2 every process must call
    it (each shard is gathered); unsharded it only copies."""
    weights = trainable_state(model)
    if optimizer is None:
        return FullState(weights, None)
    state = optimizer.state_dict()
    whole = {
        index: {
            key: full_tensor(value).cpu() if isinstance(value, torch.Tensor) else value
            for key, value in per_param.items()
        }
        for index, per_param in state["state"].items()
    }
    return FullState(weights, {**state, "state": whole})


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state cut like the parameters it belongs to (each process's shard under FSDP2)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cut = {}
    for index, per_param in state["state"].items():
        param = params[int(index)]
        cut[index] = {
            key: shard_like(value, param)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in per_param.items()
        }
    return {**state, "state": cut}


def _load_trainable(model: torch.nn.Module, path: Path) -> None:
    saved = load_file(path, device="cpu")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit {type(model).__name__}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; load it into the model (and LoRA settings) it was trained with"
        )
    with torch.no_grad():
        for name, param in params.items():
            if saved[name].shape != param.shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(saved[name].shape)}, the model has "
                    f"{tuple(param.shape)}; load it into the model it was trained with"
                )
            local_part(param).copy_(local_part(shard_like(saved[name], param)))


# --------------------------------------------------------------------------- save


def _write_contents(tmp: Path, step: int, state: FullState, scheduler, rng, history, lineage) -> None:
    save_file(state.weights, tmp / WEIGHTS, metadata={"step": str(step)})
    _fsync_file(tmp / WEIGHTS)
    scheduler_state = None if scheduler is None else scheduler.state_dict()
    for name, obj in ((OPTIMIZER, state.optimizer), (SCHEDULER, scheduler_state)):
        if obj is not None:
            with open(tmp / name, "wb") as handle:
                torch.save(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
    tensors: dict[str, torch.Tensor] = {}
    _write_json(tmp / RNG_JSON, split_tensors(rng, "rng", tensors))
    save_file(tensors, tmp / RNG_TENSORS)
    _fsync_file(tmp / RNG_TENSORS)
    _write_json(tmp / HISTORY, history)
    _write_json(tmp / LINEAGE, lineage)
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(tmp.iterdir())
    }
    # Written last: its presence means every file above is complete.
    _write_json(tmp / MARKER, {"format": FORMAT_VERSION, "step": step, "files": files})
    _fsync_dir(tmp)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    rng: dict[str, Any],
    history: list[dict[str, Any]],
    lineage: dict[str, Any],
    keep_last: int,
    state: FullState | None = None,
    keep: Collection[int] = (),
) -> Path:
    """Write a complete checkpoint of ``step`` atomically, prune old ones, return its path.

    Pass the unwrapped model (not a DDP/accelerate wrapper) so parameter names match at load time.
    ``state``: ``full_state(model, optimizer)`` taken on every process beforehand (FSDP2: a gather the
    writing process cannot do alone); None: taken here. ``keep``: earlier steps whose checkpoints pruning
    spares beyond ``keep_last`` (the best one checkpoint selection has seen so far).
    """
    if keep_last < 1:
        raise CheckpointError(f"checkpoint.keep_last must be >= 1 (got {keep_last}): fix it in params.yaml")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # os-level randomness: the training RNG streams must not move because a checkpoint was taken.
    tmp = run_dir / f"{TMP_PREFIX}{step:08d}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_contents(tmp, step, state or full_state(model, optimizer), scheduler, rng, history, lineage)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = checkpoint_path(run_dir, step)
    if final.exists():  # the same step saved again (a resumed run): set the old one aside first
        old = run_dir / f"{TMP_PREFIX}{step:08d}-old-{secrets.token_hex(4)}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    _prune(run_dir, final, keep_last, keep)
    return final


def _prune(run_dir: Path, newest: Path, keep_last: int, keep: Collection[int] = ()) -> None:
    """Delete stale temp dirs, checkpoints after ``newest`` and all but ``keep_last`` complete ones (and
    the steps of ``keep``).

    A checkpoint with a later step than the one just written belongs to an abandoned timeline (the
    run restarted from an earlier point); left in place, the next resume would pick it up.
    """
    for path in run_dir.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
    newest_step = _step_of(newest)
    older = []
    for path in run_dir.iterdir():
        step = _step_of(path)
        if step is None or path == newest:
            continue
        if step > newest_step or _problem(path, hashes=False) is not None:
            shutil.rmtree(path, ignore_errors=True)
        elif step not in keep:
            older.append((step, path))
    for _, path in sorted(older)[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- read


def _problem(path: Path, hashes: bool = True) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is."""
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} completion marker (the save was interrupted)"
    try:
        state = json.loads(marker.read_text(encoding="utf-8"))
        files, step = state["files"], state["step"]
    except (ValueError, KeyError, TypeError) as exc:  # a marker cut short or overwritten
        return f"unreadable {MARKER} ({exc})"
    if _step_of(path) != step:
        return f"{MARKER} says step {step}, the directory name says otherwise"
    if not isinstance(files, dict) or WEIGHTS not in files:
        return f"{MARKER} has no manifest of {WEIGHTS}"
    for name, expected in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != expected.get("bytes"):
            return f"{name} is missing or has the wrong size (truncated)"
        if hashes and file_sha256(file) != expected.get("sha256"):
            return f"{name} does not match its sha256 in {MARKER} (corrupt)"
    return None


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint whose marker is present and whose files match its manifest."""
    return _step_of(Path(path)) is not None and _problem(Path(path)) is None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir``; half-written or corrupt ones are skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    candidates = sorted(
        ((step, path) for path in run_dir.iterdir() if (step := _step_of(path)) is not None),
        reverse=True,
    )
    return next((path for _, path in candidates if _problem(path) is None), None)


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``, oldest first (files checked by size)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    steps = ((_step_of(path), path) for path in run_dir.iterdir())
    return sorted(step for step, path in steps if step is not None and _problem(path, hashes=False) is None)


def _load_state_dict(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary pickled objects
        raise CheckpointError(
            f"{path} could not be read as a plain state dict ({exc}); it is not trusted"
        ) from None


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
) -> Restored:
    """Restore weights, optimizer and scheduler in place; return step, RNG states, history, lineage.
    Under FSDP2 each process keeps its shard of the saved whole tensors."""
    path = Path(path)
    problem = _problem(path) if _step_of(path) is not None else "not a checkpoint-XXXXXXXX directory"
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {problem}; resume from latest_checkpoint()"
        )
    _load_trainable(model, path / WEIGHTS)
    for name, obj in ((OPTIMIZER, optimizer), (SCHEDULER, scheduler)):
        if obj is None:
            continue
        if not (path / name).is_file():
            raise CheckpointError(f"{path} has no {name}: it was saved without one; pass None to skip it")
        saved = _load_state_dict(path / name)
        obj.load_state_dict(_shard_optimizer_state(obj, saved) if obj is optimizer else saved)
    tensors = load_file(path / RNG_TENSORS, device="cpu")
    rng = join_tensors(json.loads((path / RNG_JSON).read_text(encoding="utf-8")), tensors)
    history = json.loads((path / HISTORY).read_text(encoding="utf-8"))
    lineage = json.loads((path / LINEAGE).read_text(encoding="utf-8"))
    step = json.loads((path / MARKER).read_text(encoding="utf-8"))["step"]
    return Restored(step, rng, history, lineage)
