"""grpo/train/rng_state.py: every random stream a run uses is captured and replayed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from grpo.train.rng_state import RngStateError, capture_rng, restore_rng


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
