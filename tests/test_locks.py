"""grpo/locks.py: one writer per output folder, for every stage that writes, with DVC or without."""

from __future__ import annotations

import errno
import importlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.locks import FolderLockedError, folder_lock, lock_path

HOLD = "import sys, time\nfrom grpo.locks import folder_lock\nwith folder_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n"


def _hold(folder: Path, tmpdir: Path | None = None) -> subprocess.Popen:
    """A process that holds the lock of ``folder`` until killed (``tmpdir``: its own TMPDIR)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
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
    with pytest.raises(FolderLockedError, match=rf"{folder} is being written by PID {proc.pid} on {socket.gethostname()} \(`-c .*processed`"):
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


def test_a_stage_that_fails_leaves_its_folder_unlocked_for_this_process_too(tmp_path):
    """After a failed stage (a Prefect retry runs the next attempt in the same process) the folder is no
    longer counted as held here: the next writer takes the lock again, and is refused when another has it."""
    folder = tmp_path / "models" / "sft"
    with pytest.raises(RuntimeError), folder_lock(folder):
        raise RuntimeError("the stage failed")
    proc = _hold(folder)
    try:
        with pytest.raises(FolderLockedError, match=f"PID {proc.pid}"), folder_lock(folder):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_the_holder_line_replaces_a_longer_earlier_one(tmp_path):
    folder = tmp_path / "data" / "processed"
    lock_path(folder).parent.mkdir(parents=True)
    lock_path(folder).write_text("PID 1 on a-host-with-a-very-long-name (`" + "x" * 300 + "`)\n")
    with folder_lock(folder):
        text = lock_path(folder).read_text()
    assert text.startswith(f"PID {os.getpid()} on ") and text.count("\n") == 1 and "x" * 10 not in text


def test_the_lock_lives_beside_its_folder_never_in_it_and_a_stage_can_reenter(tmp_path, monkeypatch):
    """Beside: a DVC output folder hashes all it holds, so the lock file must not be in it."""
    folder = tmp_path / "models" / "grpo"
    with folder_lock(folder, tmp_path / "runs" / "default"):
        with folder_lock(folder):  # the same process (e.g. a stage calling another) is not locked out
            pass
    assert lock_path(folder) == tmp_path / "models" / ".grpo.lock"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "models", "models/.grpo.lock", "runs", "runs/.default.lock"]
    monkeypatch.chdir(tmp_path)
    assert lock_path(Path("models/grpo")) == lock_path(folder)  # relative and absolute spellings: one lock
    (tmp_path / "link").symlink_to(tmp_path / "models")
    assert lock_path(tmp_path / "link" / "grpo") == lock_path(folder)  # a symlinked spelling: the same lock


def test_git_and_dvc_ignore_the_lock_files():
    root = Path(__file__).parents[1]
    for ignore in (".gitignore", ".dvcignore"):
        assert ".*.lock" in (root / ignore).read_text(encoding="utf-8").splitlines(), ignore


def _grpo(command: str, params: Path, tmpdir: Path) -> subprocess.CompletedProcess:
    tmpdir.mkdir(parents=True, exist_ok=True)
    grpo = str(Path(sys.executable).with_name("grpo"))
    return subprocess.run([grpo, command, "--params", str(params)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmpdir)}, cwd=params.parent)


@pytest.mark.parametrize(("command", "folder"), [("train", "runs/default"), ("prepare", "data/processed")])
def test_a_second_writer_with_another_tmpdir_is_refused_naming_the_holder(tmp_path, command, folder):
    """Per-job TMPDIRs (SLURM, PrivateTmp, two users): both writers still meet the one lock of the folder."""
    project = tmp_path / "project"
    params = project / "params.yaml"
    project.mkdir()
    params.write_text("data:\n  n_train: 8\n  n_eval: 4\n")
    proc = _hold(project / folder, tmpdir=tmp_path / "tmp-a")
    try:
        done = _grpo(command, params, tmp_path / "tmp-b")
    finally:
        proc.kill()
        proc.wait()
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{project / folder} is being written by PID {proc.pid} on {socket.gethostname()}" in done.stderr
    assert not (project / folder).exists()  # the refused stage wrote nothing into the folder


def test_a_file_system_without_locks_stops_the_stage_instead_of_running_unlocked(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("fcntl.flock", no_locks)
    with pytest.raises(FolderLockedError, match=r"its file system refuses the lock on .*\.grpo\.lock .*-o flock"):
        with folder_lock(tmp_path / "models" / "grpo"):
            pytest.fail("the stage ran without its lock")


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


def test_a_stage_reenters_its_folder_under_another_spelling(tmp_path, monkeypatch):
    """The trainer holds ``models/grpo`` by an absolute path; a helper it calls names it relative to the
    project root (or through a symlink): the same folder, held by this process, so no refusal."""
    folder = tmp_path / "models" / "grpo"
    (tmp_path / "link").symlink_to(tmp_path / "models", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    with folder_lock(folder):
        with folder_lock(Path("models/grpo")), folder_lock(tmp_path / "link" / "grpo"):
            pass


def test_the_lock_of_a_folder_whose_parents_do_not_exist_yet(tmp_path):
    folder = tmp_path / "runs" / "nightly" / "models" / "grpo"
    with folder_lock(folder):
        assert lock_path(folder).is_file() and not folder.exists()  # the stage makes its own folder
