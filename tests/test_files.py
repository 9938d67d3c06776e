"""grpo/files.py, grpo/seeding.py, grpo/paths.py: the root helpers every layer uses."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from grpo import paths
from grpo.config import config_from_dict
from grpo.files import file_sha256, write_atomically, write_json, write_text
from grpo.seeding import derive_seed


def test_write_is_all_or_nothing(tmp_path):
    good, blocked = tmp_path / "train.jsonl", tmp_path / "file" / "eval.jsonl"
    good.write_text("old\n")
    (tmp_path / "file").write_text("a file where a folder should be")
    with pytest.raises(OSError):
        write_atomically({good: "new\n", blocked: "new\n"})
    assert good.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "train.jsonl"]  # no temp file left


def test_text_json_and_bytes_land_whole_with_parents_created(tmp_path):
    assert write_text(tmp_path / "a" / "b" / "c.md", "# é\n").read_text(encoding="utf-8") == "# é\n"  # two new levels
    assert json.loads(write_json(tmp_path / "m.json", {"x": 1}).read_text()) == {"x": 1}
    write_atomically({tmp_path / "p.png": b"\x89PNG\x00"})
    assert (tmp_path / "p.png").read_bytes() == b"\x89PNG\x00"
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_each_file_is_staged_beside_its_target_and_on_disk_before_the_rename(tmp_path, monkeypatch):
    """A sibling, so the rename stays on one file system (atomic; across file systems it fails with EXDEV),
    and fsynced first, so a crash after the rename never leaves an empty file under the final name."""
    events: list[tuple[str, object]] = []
    fsync, replace = os.fsync, os.replace

    def spied_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))  # the staged file's path
        fsync(fd)

    def spied_replace(src, dst):
        events.append(("replace", (str(src), str(dst))))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spied_fsync)
    monkeypatch.setattr(os, "replace", spied_replace)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    targets = [tmp_path / "metrics" / "grpo.json", tmp_path / "reports" / "grpo.md"]
    write_atomically(dict.fromkeys(targets, "x\n"))
    synced = [what for kind, what in events if kind == "fsync"]
    renames = [what for kind, what in events if kind == "replace"]
    assert [Path(dst) for _, dst in renames] == targets
    for src, dst in renames:
        assert Path(src).parent == Path(dst).parent and src in synced
    assert events.index(("replace", renames[0])) > max(i for i, (kind, _) in enumerate(events) if kind == "fsync")


def test_file_sha256_is_the_sha256_of_the_bytes(tmp_path):
    data = bytes(range(256)) * 5000  # more than one 1 MiB block
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_derived_seeds_are_stable_and_never_shared_between_draws():
    assert derive_seed(7, ("step", 3)) == derive_seed(7, ("step", 3))
    draws = {derive_seed(seed, ("step", step), ("attempt", attempt))
             for seed in (0, 1) for step in range(50) for attempt in range(3)}
    assert len(draws) == 2 * 50 * 3
    # Names count: a step and an attempt with the same numbers are different draws.
    assert derive_seed(7, ("step", 1), ("attempt", 0)) != derive_seed(7, ("attempt", 1), ("step", 0))
    assert 0 <= derive_seed(2**40, ("step", 10**9)) < 2**63


def test_every_artifact_path_comes_from_params_paths_and_experiment(tmp_path):
    cfg = config_from_dict({"experiment": "e1", "paths": {
        "data_dir": str(tmp_path / "d"), "models_dir": str(tmp_path / "m"), "metrics_dir": str(tmp_path / "x"),
        "reports_dir": str(tmp_path / "r"), "runs_dir": str(tmp_path / "u")}})
    assert paths.data_file(cfg, "eval") == tmp_path / "d" / "eval.jsonl"
    assert paths.model_dir(cfg, "sft") == tmp_path / "m" / "sft"
    assert paths.run_dir(cfg) == tmp_path / "u" / "e1"
    assert paths.step_metrics_file(paths.run_dir(cfg)) == tmp_path / "u" / "e1" / "metrics.jsonl"
    assert paths.entropy_history_file(paths.run_dir(cfg), "e1") == tmp_path / "u" / "e1" / "entropy_history_e1.json"
    assert paths.metrics_file(cfg, "grpo") == tmp_path / "x" / "grpo.json"
    assert paths.report_file(cfg, "eval.md") == tmp_path / "r" / "eval.md"
    with pytest.raises(ValueError, match="unknown model folder 'rl'"):
        paths.model_dir(cfg, "rl")


def test_stage_inputs_are_what_each_artifact_is_made_from(tmp_path):
    cfg = config_from_dict({"paths": {"data_dir": "d", "models_dir": "m"}})
    assert paths.stage_inputs(cfg, "base") == {"train": paths.data_file(cfg, "train")}
    assert paths.stage_inputs(cfg, "sft") == {"base": paths.model_dir(cfg, "base"), "train": paths.data_file(cfg, "train")}
    assert paths.stage_inputs(cfg, "grpo") == {"sft": paths.model_dir(cfg, "sft"), "train": paths.data_file(cfg, "train")}
    assert paths.stage_inputs(cfg, "preflight") == {"base": paths.model_dir(cfg, "base"), "sft": paths.model_dir(cfg, "sft")}
    real = config_from_dict({"model": {"name_or_path": str(tmp_path)}})
    assert paths.stage_inputs(real, "base") == {}  # a resolved real model reads nothing of ours
    with pytest.raises(ValueError, match="records no lineage inputs"):
        paths.stage_inputs(cfg, "evaluate")
