"""grpo/locks.py: one writer per output folder, for every stage that writes, with DVC or without."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.locks import FolderLockedError, folder_lock, lock_path

HOLD = "import sys, time\nfrom grpo.locks import folder_lock\nwith folder_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n"


def _hold(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the lock of ``<tmp>/data/processed`` until killed."""
    folder = tmp_path / "data" / "processed"
    proc = _hold(folder)
    yield folder, proc
    proc.kill()
    proc.wait()


def test_a_second_writer_gets_an_error_naming_the_holder(holder):
    folder, proc = holder
    with pytest.raises(FolderLockedError, match=rf"{folder} is being written by PID {proc.pid} \(`-c .*processed`"):
        with folder_lock(folder):
            pass


def test_the_lock_dies_with_its_holder_even_on_kill_9(holder):
    folder, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with folder_lock(folder):
        assert f"PID {os.getpid()}" in lock_path(folder).read_text()


def test_every_writing_stage_takes_the_lock_of_its_folder(holder, tmp_path, capsys):
    folder, proc = holder
    cfg = config_from_dict({"paths": {"data_dir": str(folder)}, "data": {"n_train": 8, "n_eval": 4}})
    with pytest.raises(FolderLockedError, match=f"PID {proc.pid}"):
        prepare.run(cfg)
    assert not folder.exists()  # nothing was written
    params = tmp_path / "params.yaml"
    params.write_text(f"paths:\n  data_dir: {folder}\ndata:\n  n_train: 8\n  n_eval: 4\n")
    assert main(["prepare", "--params", str(params)]) == 1
    assert f"is being written by PID {proc.pid}" in capsys.readouterr().err


def test_the_lock_writes_nothing_in_the_project_and_a_stage_can_reenter(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "grpo"
    with folder_lock(folder, tmp_path / "runs" / "default"):
        with folder_lock(folder):  # the same process (e.g. a stage calling another) is not locked out
            pass
    assert not any(tmp_path.iterdir())
    monkeypatch.chdir(tmp_path)
    assert lock_path(Path("models/grpo")) == lock_path(folder)  # relative and absolute spellings: one lock


@pytest.mark.parametrize(
    ("module", "folder"),
    [("grpo.data.validate", "reports"), ("grpo.train.pretrain", "models/base"), ("grpo.train.sft", "models/sft"),
     ("grpo.train.trainer", "models/grpo"), ("grpo.train.trainer", "runs/default"),
     ("grpo.eval.evaluate", "metrics")],
)
def test_each_writing_stage_refuses_a_folder_another_process_writes(tmp_path, module, folder):
    paths = {key: str(tmp_path / key) for key in ("models", "runs", "metrics", "reports")}
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data"), **{f"{k}_dir": v for k, v in paths.items()}}})
    proc = _hold(tmp_path / folder)
    try:
        with pytest.raises(FolderLockedError, match=f"PID {proc.pid}"):
            importlib.import_module(module).run(cfg)
    finally:
        proc.kill()
        proc.wait()


def test_a_distributed_run_is_one_writer_whose_rank_0_holds_the_lock(holder, monkeypatch):
    folder, proc = holder  # plays rank 0 of the same run
    monkeypatch.setenv("RANK", "1")
    with folder_lock(folder):  # the other ranks do not take it
        pass
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(FolderLockedError, match=f"PID {proc.pid}"):
        with folder_lock(folder):
            pass
