"""One-off params and profiles run in their own workspace, so they never replace the project's ``params.yaml``.

DVC reads ``params.yaml`` only. A run with another params file (``-p params_path=other.yaml``, or
``make run PROFILE=smollm2`` for ``configs/smollm2.yaml``) therefore gets its own DVC project,
``.workspaces/<name>/`` inside the project (git-ignored): the project's code and DVC config as git
would commit them (not its outputs, the ``paths.*`` folders), that file as the workspace's
``params.yaml`` (a profile's ``extends`` resolved: the whole tree, every key DVC looks up written out),
and the project's DVC cache shared (``.dvc/config.local``), so nothing is stored twice. Its outputs
(``data/``, ``models/``, ``reports/``, ``metrics/``, ``runs/``) and its ``dvc.lock`` live only there:
the lock pins the one-off params, each model's ``lineage.json`` carries their hash, and the project's
``params.yaml``, ``dvc.lock`` and model folders are never written. A later run with the same file
reuses the workspace and reruns only what is stale there.

The workspace is a git repository of its own, so ``dvc metrics diff`` and ``dvc params diff`` work
there (DVC compares with git's ``HEAD``): before a run refreshes its code and params, everything the
last run left (its ``params.yaml``, ``dvc.lock``, ``metrics/key/``, reports; models and data are
git-ignored) is committed. After a run, ``dvc metrics diff`` in the workspace shows what changed since
the run before it, ``dvc params diff`` which params did.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from grpo.config import PathsConfig, read_params

WORKSPACES_DIR = ".workspaces"
NOT_COPIED = ("params.yaml", "dvc.lock")
"""The workspace's own: its params (the one-off file) and what DVC recorded there."""


def output_dirs(project: Path) -> tuple[str, ...]:
    """The project's output folders (``paths.*`` of its params.yaml: data, models, metrics, reports,
    runs): a workspace makes its own, so the project's are never copied (nor committed there)."""
    paths = PathsConfig.model_validate(read_params(project / "params.yaml").get("paths") or {})
    return tuple(Path(folder).as_posix().rstrip("/") + "/" for folder in paths.model_dump().values())


class WorkspaceError(RuntimeError):
    """The project cannot be copied into a workspace (not a git checkout, a clashing name)."""


def code_files(project: Path) -> list[str]:
    """Files git would commit in ``project`` (tracked and untracked, not ignored), except the run's own."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        raise WorkspaceError(
            f"{project}: `git ls-files` failed ({listed.stderr.strip()}): a run with params_path other than "
            "params.yaml copies the project's committed files into a workspace, so the project must be a git "
            "checkout; or run with params_path=params.yaml"
        )
    names = {name for name in listed.stdout.split("\0") if name}
    skipped = (WORKSPACES_DIR + "/", *output_dirs(project))
    return sorted(
        n for n in names if n not in NOT_COPIED and not n.startswith(skipped) and (project / n).is_file()
    )


def workspace_name(params: Path) -> str:
    return params.stem if params.suffix in (".yaml", ".yml") else params.name


GIT_IDENTITY = (
    "-c",
    "user.name=grpo-dual",
    "-c",
    "user.email=grpo-dual@localhost",
    "-c",
    "commit.gpgsign=false",
)
"""The workspace's commits are the pipeline's, made whether or not the machine has a git identity."""


def _git(workspace: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *GIT_IDENTITY, *args], cwd=workspace, capture_output=True, text=True)


def commit_all(workspace: Path, message: str) -> bool:
    """Commit everything git does not ignore in ``workspace`` (its own repository); False if nothing changed."""
    steps = [("init", "-q")] if not (workspace / ".git").is_dir() else []
    for step in [*steps, ("add", "-A")]:
        if (done := _git(workspace, *step)).returncode != 0:
            raise WorkspaceError(f"{workspace}: `git {step[0]}` failed ({done.stderr.strip()})")
    if _git(workspace, "diff", "--cached", "--quiet").returncode == 0 and _has_commit(workspace):
        return False
    if (done := _git(workspace, "commit", "-q", "--allow-empty", "-m", message)).returncode != 0:
        raise WorkspaceError(f"{workspace}: `git commit` failed ({done.stderr.strip()})")
    return True


def _has_commit(workspace: Path) -> bool:
    """Whether ``workspace`` is a repository of its own with a commit (not just inside the project's)."""
    return (workspace / ".git").is_dir() and _git(
        workspace, "rev-parse", "--verify", "-q", "HEAD"
    ).returncode == 0


def make_workspace(project: Path, params: Path) -> Path:
    """``project/.workspaces/<params stem>/``: the project's code, ``params`` as its params.yaml, shared cache;
    the last run's state committed first (its own git repository: ``dvc metrics diff`` works there)."""
    workspace = project / WORKSPACES_DIR / workspace_name(params)
    if workspace.is_dir():
        commit_all(
            workspace, f"the last run with {params.name}: its params, dvc.lock, key metrics and reports"
        )
    for name in code_files(project):
        target = workspace / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project / name, target)
    (workspace / "params.yaml").write_text(
        yaml.safe_dump(read_params(params), sort_keys=False), encoding="utf-8"
    )
    (workspace / ".dvc").mkdir(exist_ok=True)
    (workspace / ".dvc" / "config.local").write_text(
        f"[cache]\n    dir = {project / '.dvc' / 'cache'}\n", encoding="utf-8"
    )
    if not _has_commit(workspace):
        commit_all(workspace, f"workspace of {params.name}: the project's code, {params.name} as params.yaml")
    return workspace


def run_folder(project: Path, params: Path) -> Path:
    """Where a run with ``params`` works: the project itself for its ``params.yaml``, else a workspace."""
    project, params = project.resolve(), params.resolve()
    return project if params == project / "params.yaml" else make_workspace(project, params)


if (
    __name__ == "__main__"
):  # `python -m tasks.workspace PARAMS`: print the folder `dvc repro` runs in (Makefile)
    print(run_folder(Path.cwd(), Path(sys.argv[1])))
