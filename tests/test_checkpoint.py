"""Checkpoints: exact resume on the tiny model, keep_last, and half-written checkpoints never read."""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import numpy as np
import pytest
import torch

from grpo.model.tiny import build_tiny_model
from grpo.train.checkpoint import (
    MARKER,
    OPTIMIZER,
    WEIGHTS,
    CheckpointError,
    checkpoint_path,
    checkpoint_steps,
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from grpo.train.rng_state import capture_rng, restore_rng

LINEAGE = {"stage": "grpo", "code": "abc123"}


def make_training(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    return optimizer, scheduler


def train(model, optimizer, scheduler, steps: int, data_gen: torch.Generator) -> list[float]:
    """Steps whose data and loss weights draw on every RNG a run uses, so each must be restored."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=data_gen)
        weight = 1.0 + torch.rand(()) + random.random() + float(np.random.rand())
        loss = model(input_ids=ids, labels=ids).loss * weight
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def quick_save(run_dir, step, model, keep_last=5, history=None, keep=()):
    optimizer, scheduler = make_training(model)
    return save_checkpoint(
        run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, rng=capture_rng(),
        history=history or [{"step": step}], lineage=LINEAGE, keep_last=keep_last, keep=keep,
    )


def test_resume_is_bit_exact(tmp_path, tiny_model, tiny_tokenizer, tiny_sizes):
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    data_gen = torch.Generator().manual_seed(7)
    model = tiny_model.train()
    optimizer, scheduler = make_training(model)
    history = [{"step": s + 1, "loss": x} for s, x in enumerate(train(model, optimizer, scheduler, 2, data_gen))]
    saved = save_checkpoint(
        tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler,
        rng=capture_rng({"data": data_gen}), history=history, lineage=LINEAGE, keep_last=2,
    )
    tail = train(model, optimizer, scheduler, 3, data_gen)

    # A fresh process: other initial weights, fresh optimizer, every RNG somewhere else.
    resumed = build_tiny_model(tiny_tokenizer, tiny_sizes, seed=1).train()
    optimizer2, scheduler2 = make_training(resumed)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    data_gen2 = torch.Generator().manual_seed(99)
    restored = load_checkpoint(latest_checkpoint(tmp_path), model=resumed, optimizer=optimizer2, scheduler=scheduler2)
    restore_rng(restored.rng, {"data": data_gen2})
    assert saved == checkpoint_path(tmp_path, 2) and restored.step == 2
    assert restored.history == history and restored.lineage == LINEAGE
    assert scheduler2.last_epoch == 2
    assert train(resumed, optimizer2, scheduler2, 3, data_gen2) == tail
    for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # tie survives the load
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_checkpoint_holds_only_trainable_weights(tmp_path, tiny_model):
    from safetensors.torch import load_file

    for name, param in tiny_model.named_parameters():
        param.requires_grad_(name.startswith("model.norm"))
    path = quick_save(tmp_path, 1, tiny_model)
    assert set(load_file(path / WEIGHTS)) == {"model.norm.weight"}
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 1 and WEIGHTS in marker["files"] and OPTIMIZER in marker["files"]


def test_keep_last_deletes_older_checkpoints(tmp_path, tiny_model):
    for step in range(1, 6):
        quick_save(tmp_path, step, tiny_model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000004", "checkpoint-00000005"]


def test_pruning_spares_the_checkpoint_selection_keeps(tmp_path, tiny_model):
    """``keep`` (the best checkpoint checkpoint selection has seen) outlives ``keep_last``: with one kept
    and step 2 the best, steps 2 and 5 remain."""
    for step in range(1, 6):
        quick_save(tmp_path, step, tiny_model, keep_last=1, keep=(2,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000002", "checkpoint-00000005"]


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(tmp_path, tiny_model):
    for step in (5, 10):
        quick_save(tmp_path, step, tiny_model)
    quick_save(tmp_path, 6, tiny_model)  # the run restarted from step 5
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 6)
    assert not checkpoint_path(tmp_path, 10).exists()


def test_directory_without_marker_is_skipped(tmp_path, tiny_model):
    good = quick_save(tmp_path, 1, tiny_model)
    half = checkpoint_path(tmp_path, 2)
    shutil.copytree(good, half)
    (half / MARKER).unlink()  # killed before the marker was written
    assert not is_complete(half)
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="completion marker"):
        load_checkpoint(half, model=tiny_model, optimizer=None, scheduler=None)


def test_truncated_or_corrupt_weights_are_skipped(tmp_path, tiny_model):
    good = quick_save(tmp_path, 1, tiny_model)
    bad = quick_save(tmp_path, 2, tiny_model)
    weights = bad / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert latest_checkpoint(tmp_path) == good
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, flipped bits
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(bad, model=tiny_model, optimizer=None, scheduler=None)


def test_failed_save_leaves_no_trace_and_the_previous_checkpoint_stands(tmp_path, tiny_model):
    good = quick_save(tmp_path, 1, tiny_model)
    with pytest.raises(TypeError):
        quick_save(tmp_path, 2, tiny_model, history=[{"step": 2, "bad": object()}])
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]
    assert latest_checkpoint(tmp_path) == good


def test_stale_temp_dirs_are_ignored_then_cleaned(tmp_path, tiny_model):
    good = quick_save(tmp_path, 1, tiny_model)
    stale = tmp_path / ".tmp-step-00000002-deadbeef"
    shutil.copytree(good, stale)  # a save killed just before its rename
    assert latest_checkpoint(tmp_path) == good
    quick_save(tmp_path, 3, tiny_model)
    assert not stale.exists()


def test_optimizer_state_is_never_unpickled(tmp_path, tiny_model):
    path = quick_save(tmp_path, 1, tiny_model)
    torch.save({"state": {}, "param_groups": [], "evil": CheckpointError("pickled object")}, path / OPTIMIZER)
    data = (path / OPTIMIZER).read_bytes()  # re-sign the manifest: the file is "complete", just hostile
    marker = json.loads((path / MARKER).read_text())
    marker["files"][OPTIMIZER] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(marker))
    optimizer, _ = make_training(tiny_model)
    with pytest.raises(CheckpointError, match="not trusted"):
        load_checkpoint(path, model=tiny_model, optimizer=optimizer, scheduler=None)


def test_loading_into_another_architecture_names_the_mismatch(tmp_path, tiny_model, tiny_tokenizer, tiny_sizes):
    path = quick_save(tmp_path, 1, tiny_model)
    other = build_tiny_model(tiny_tokenizer, tiny_sizes.model_copy(update={"num_hidden_layers": 1}), seed=0)
    with pytest.raises(CheckpointError, match="missing|unexpected"):
        load_checkpoint(path, model=other, optimizer=None, scheduler=None)


def test_latest_checkpoint_of_missing_or_empty_dir_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None


def test_history_tensors_are_stored_as_numbers(tmp_path, tiny_model):
    history = [{"step": 1, "cagrad/weights": torch.tensor([0.25, 0.75]), "reward": np.float32(0.5)}]
    path = quick_save(tmp_path, 1, tiny_model, history=history)
    restored = load_checkpoint(path, model=tiny_model, optimizer=None, scheduler=None)
    assert restored.history == [{"step": 1, "cagrad/weights": [0.25, 0.75], "reward": 0.5}]


def test_the_same_step_saved_again_replaces_the_old_checkpoint(tmp_path, tiny_model):
    """A resume that skipped a corrupt newest checkpoint saves that step again over the corrupt folder."""
    quick_save(tmp_path, 3, tiny_model, history=[{"step": 3, "run": 1}])
    (checkpoint_path(tmp_path, 3) / WEIGHTS).write_bytes(b"corrupt")
    path = quick_save(tmp_path, 3, tiny_model, history=[{"step": 3, "run": 2}])
    assert latest_checkpoint(tmp_path) == path and is_complete(path)
    assert json.loads((path / "history.json").read_text()) == [{"step": 3, "run": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("name", [OPTIMIZER, "history.json", "rng.json"])
def test_every_file_of_a_checkpoint_is_verified_not_only_the_weights(tmp_path, tiny_model, name):
    good = quick_save(tmp_path, 1, tiny_model)
    bad = quick_save(tmp_path, 2, tiny_model)
    data = (bad / name).read_bytes()
    (bad / name).write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, flipped bits
    assert latest_checkpoint(tmp_path) == good
    (bad / name).write_bytes(data[:-1])  # one byte short: the quick check by size sees it too
    assert checkpoint_steps(tmp_path) == [1]


def test_a_checkpoint_saved_without_an_optimizer_cannot_restore_one(tmp_path, tiny_model):
    path = save_checkpoint(tmp_path, 1, model=tiny_model, optimizer=None, scheduler=None, rng=capture_rng(),
                           history=[], lineage=LINEAGE, keep_last=2)
    optimizer, _ = make_training(tiny_model)
    with pytest.raises(CheckpointError, match=f"has no {OPTIMIZER}: it was saved without one"):
        load_checkpoint(path, model=tiny_model, optimizer=optimizer, scheduler=None)


def test_a_checkpoint_under_another_steps_name_is_not_complete(tmp_path, tiny_model):
    """The marker's step must be the folder's: a checkpoint of step 2 copied to step 7's name is not step 7."""
    good = quick_save(tmp_path, 2, tiny_model)
    shutil.copytree(good, checkpoint_path(tmp_path, 7))
    assert not is_complete(checkpoint_path(tmp_path, 7))
    assert latest_checkpoint(tmp_path) == good and checkpoint_steps(tmp_path) == [2]


def test_a_weight_of_another_shape_is_refused_even_where_it_would_broadcast(tmp_path):
    """A saved [1, 3] weight copied into a [2, 3] parameter would broadcast silently into every row."""
    path = save_checkpoint(tmp_path, 1, model=torch.nn.Linear(3, 1), optimizer=None, scheduler=None,
                           rng=capture_rng(), history=[], lineage=LINEAGE, keep_last=2)
    with pytest.raises(CheckpointError, match=r"weight has shape \(1, 3\), the model has \(2, 3\)"):
        load_checkpoint(path, model=torch.nn.Linear(3, 2), optimizer=None, scheduler=None)


def test_keep_last_below_one_is_refused_with_the_fix(tmp_path, tiny_model):
    with pytest.raises(CheckpointError, match=r"keep_last must be >= 1 \(got 0\): fix it in params.yaml"):
        quick_save(tmp_path, 1, tiny_model, keep_last=0)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_checkpoint_goes_into_a_run_folder_not_made_yet(tmp_path, tiny_model):
    run_dir = tmp_path / "runs" / "grpo"
    first = quick_save(run_dir, 1, tiny_model)
    second = quick_save(run_dir, 2, tiny_model)  # the folder exists now
    assert is_complete(first) and is_complete(second)


def test_a_manifest_without_the_weights_is_not_complete(tmp_path, tiny_model):
    path = quick_save(tmp_path, 1, tiny_model)
    marker = json.loads((path / MARKER).read_text())
    del marker["files"][WEIGHTS]
    (path / MARKER).write_text(json.dumps(marker))
    assert not is_complete(path) and latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match=f"has no manifest of {WEIGHTS}"):
        load_checkpoint(path, model=tiny_model, optimizer=None, scheduler=None)


def test_the_scheduler_is_restored_without_an_optimizer(tmp_path, tiny_model):
    optimizer, scheduler = make_training(tiny_model)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    path = save_checkpoint(tmp_path, 3, model=tiny_model, optimizer=optimizer, scheduler=scheduler,
                           rng=capture_rng(), history=[], lineage=LINEAGE, keep_last=2)
    _, fresh = make_training(tiny_model)
    load_checkpoint(path, model=tiny_model, optimizer=None, scheduler=fresh)
    assert fresh.state_dict()["last_epoch"] == 3 == scheduler.state_dict()["last_epoch"]
