"""One-off params and profiles run in their own workspace, so they never replace the project's ``params.yaml``.

DVC reads ``params.yaml`` only. A run with another params file (``-p params_path=other.yaml``, or
``make run PROFILE=smollm2`` for ``configs/smollm2.yaml``) therefore gets its own DVC project,
``.workspaces/<name>/`` inside the project (git-ignored): the project's code and DVC config as git
would commit them, that file as the workspace's ``params.yaml`` (a profile's ``extends`` resolved: the
whole tree, every key DVC looks up written out),
and the project's DVC cache shared (``.dvc/config.local``), so nothing is stored twice. Its outputs
(``data/``, ``models/``, ``reports/``, ``metrics/``, ``runs/``) and its ``dvc.lock`` live only there:
the lock pins the one-off params, each model's ``lineage.json`` carries their hash, and the project's
``params.yaml``, ``dvc.lock`` and model folders are never written. A later run with the same file
reuses the workspace and reruns only what is stale there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from grpo.config import read_params

WORKSPACES_DIR = ".workspaces"
NOT_COPIED = ("params.yaml", "dvc.lock")
"""The workspace's own: its params (the one-off file) and what DVC recorded there."""


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
    return sorted(
        n
        for n in names
        if n not in NOT_COPIED and not n.startswith(WORKSPACES_DIR + "/") and (project / n).is_file()
    )


def workspace_name(params: Path) -> str:
    return params.stem if params.suffix in (".yaml", ".yml") else params.name


def make_workspace(project: Path, params: Path) -> Path:
    """``project/.workspaces/<params stem>/``: the project's code, ``params`` as its params.yaml, shared cache."""
    workspace = project / WORKSPACES_DIR / workspace_name(params)
    for name in code_files(project):
        target = workspace / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project / name, target)
    (workspace / "params.yaml").write_text(
        yaml.safe_dump(read_params(params), sort_keys=False), encoding="utf-8"
    )
    (workspace / ".dvc").mkdir(exist_ok=True)
    (workspace / ".dvc" / "config.local").write_text(
        f"[core]\n    no_scm = true\n[cache]\n    dir = {project / '.dvc' / 'cache'}\n", encoding="utf-8"
    )
    return workspace


def run_folder(project: Path, params: Path) -> Path:
    """Where a run with ``params`` works: the project itself for its ``params.yaml``, else a workspace."""
    project, params = project.resolve(), params.resolve()
    return project if params == project / "params.yaml" else make_workspace(project, params)


if (
    __name__ == "__main__"
):  # `python -m tasks.workspace PARAMS`: print the folder `dvc repro` runs in (Makefile)
    print(run_folder(Path.cwd(), Path(sys.argv[1])))
