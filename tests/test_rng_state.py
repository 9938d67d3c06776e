"""grpo/train/rng_state.py: every random stream a run uses is captured and replayed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from grpo.train.rng_state import RngStateError, capture_rng, join_tensors, restore_rng, split_tensors


def test_capture_and_restore_rng_replay_every_stream():
    gen = torch.Generator().manual_seed(3)
    state = capture_rng({"g": gen})
    first = (random.random(), float(np.random.rand()), torch.rand(3), torch.rand(3, generator=gen))
    restore_rng(state, {"g": gen})
    second = (random.random(), float(np.random.rand()), torch.rand(3), torch.rand(3, generator=gen))
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    with pytest.raises(RngStateError, match="'other'"):
        restore_rng(state, {"other": torch.Generator()})


def test_split_tensors_leaves_json_and_join_tensors_puts_every_tensor_back():
    """The checkpoint writes the state as JSON plus a tensor file: the split must be JSON-able and lossless."""
    import json

    state = capture_rng({"g": torch.Generator().manual_seed(5)})
    tensors: dict[str, torch.Tensor] = {}
    tree = split_tensors(state, "rng", tensors)
    assert set(tensors) == {"rng.torch", "rng.generators.g"} | {f"rng.cuda.{i}" for i in range(len(state["cuda"]))}
    joined = join_tensors(json.loads(json.dumps(tree)), tensors)
    assert torch.equal(joined["torch"], state["torch"])
    assert torch.equal(joined["generators"]["g"], state["generators"]["g"])
    assert joined["python"] == state["python"] and joined["numpy"] == state["numpy"]
    # CUDA states are a list of tensors, one per device: lists are walked too (a CPU run has none).
    devices = {"cuda": [torch.arange(3, dtype=torch.uint8), torch.arange(4, dtype=torch.uint8)]}
    tensors = {}
    tree = split_tensors(devices, "rng", tensors)
    assert sorted(tensors) == ["rng.cuda.0", "rng.cuda.1"]
    back = join_tensors(json.loads(json.dumps(tree)), tensors)["cuda"]
    assert all(torch.equal(a, b) for a, b in zip(back, devices["cuda"], strict=True))


def test_the_pending_gaussian_of_python_random_is_replayed():
    """``random.gauss`` draws its values in pairs and keeps the second for the next call: that value is
    part of the state too, or the first gauss after a resume differs from the uninterrupted run's."""
    random.seed(4)
    random.gauss(0.0, 1.0)  # leaves the pair's second value pending
    state = capture_rng()
    first = random.gauss(0.0, 1.0)
    random.seed(5)
    restore_rng(state)
    assert random.gauss(0.0, 1.0) == first
