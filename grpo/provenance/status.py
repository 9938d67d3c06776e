"""``grpo status``: what is stale and why, code included, in one command.

``dvc status`` alone cannot answer it: the ``fingerprint`` stage is always changed (so it is never
clean), and a code edit is invisible until the fingerprints are refreshed. This refreshes them first
(``grpo fingerprint``), asks ``dvc status --json`` (the DVC command line; the library never imports
DVC), leaves the always-changed ``fingerprint`` stage out, and names the modules behind each code
change by comparing the refreshed fingerprint with the version the stage last ran with (the md5 in
``dvc.lock``, kept under ``fingerprints/history/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from grpo.config import Config
from grpo.errors import GrpoError
from grpo.provenance import stages
from grpo.provenance.fingerprint import FINGERPRINT_DIR, HISTORY_DIR, write_fingerprints


class StatusError(GrpoError):
    """``dvc status`` could not run in this folder."""


def dvc_status(project: Path) -> dict[str, list]:
    """``dvc status --json`` of ``project``: ``{stage: [reasons]}``, only stages that are not up to date."""
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=project, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise StatusError(
            f"`dvc status --json` failed in {project} (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-800:]}; run `grpo status` from the project root"
        )
    return json.loads(proc.stdout or "{}")


def recorded_md5(project: Path) -> dict[str, str]:
    """``{stage: md5 of fingerprints/<stage>.json when the stage last ran}`` from dvc.lock."""
    lock = project / "dvc.lock"
    tree = yaml.safe_load(lock.read_text(encoding="utf-8")) if lock.is_file() else None
    out = {}
    for name, entry in ((tree or {}).get("stages") or {}).items():
        for dep in entry.get("deps") or []:
            if dep.get("path") == f"{FINGERPRINT_DIR.as_posix()}/{name}.json":
                out[name] = dep.get("md5")
    return out


def _fingerprints(project: Path, stage: str, md5: str | None) -> tuple[dict, dict] | None:
    """The stage's fingerprint as recorded when it last ran (``md5``) and as it is now; None when unknown."""
    old = project / FINGERPRINT_DIR / HISTORY_DIR / f"{md5}.json"
    new = project / FINGERPRINT_DIR / f"{stage}.json"
    if not md5 or not old.is_file() or not new.is_file():
        return None
    return json.loads(old.read_text(encoding="utf-8")), json.loads(new.read_text(encoding="utf-8"))


def changed_modules(project: Path, stage: str, md5: str | None) -> list[str] | None:
    """Modules whose meaning differs from the run recorded as ``md5``; None when that run is unknown."""
    pair = _fingerprints(project, stage, md5)
    if pair is None:
        return None
    before, now = (found["modules"] for found in pair)
    return sorted(m for m in before.keys() | now.keys() if before.get(m) != now.get(m))


def changed_raw_data(project: Path, stage: str, md5: str | None) -> list[str] | None:
    """The published dataset files (``raw_data``, prepare's fingerprint only) edited, added or removed
    since the run recorded as ``md5``, one line each; None when that run is unknown."""
    pair = _fingerprints(project, stage, md5)
    if pair is None:
        return None
    before, now = (found.get("raw_data") or {} for found in pair)
    lines = []
    for key in sorted(before.keys() | now.keys()):
        old, new = before.get(key) or {}, now.get(key) or {}
        for file in sorted(old.keys() | new.keys()):
            if old.get(file) != new.get(file):
                how = "edited" if file in old and file in new else "added" if file in new else "removed"
                lines.append(f"raw data {how}: {file} ({key})")
    return lines


def _fingerprint_reasons(project: Path, stage: str, md5: str | None) -> list[str]:
    """Why the stage's fingerprint file changed: the modules behind it, the raw data files behind it."""
    modules = changed_modules(project, stage, md5)
    if modules is None:
        return ["code changed (module list unknown: the last run predates it)"]
    lines = [f"code changed ({', '.join(modules)})"] if modules else []
    lines += changed_raw_data(project, stage, md5) or []
    return lines or [f"the fingerprint of stage {stage} changed (neither a module nor a raw data file did)"]


def _reasons(entries: list, fingerprint: list[str]) -> list[str]:
    """The lines of ``dvc status``'s entries of one stage; a change of its fingerprint file reads as
    ``fingerprint``, the reasons ``_fingerprint_reasons`` found."""
    lines = []
    for entry in entries:
        if not isinstance(entry, dict):
            lines.append(str(entry))
            continue
        for kind, changes in entry.items():
            for path, change in changes.items():
                if path.startswith(f"{FINGERPRINT_DIR.as_posix()}/"):
                    lines += fingerprint
                elif isinstance(change, dict):
                    lines += [f"{path}: {key} {what}" for key, what in change.items()]
                else:
                    lines.append(f"{kind.removeprefix('changed ')}: {path} {change}")
    return lines


def status(project: Path, cfg: Config) -> dict[str, list[str]]:
    """``{stage: reasons}`` of every stale pipeline stage (empty: everything is up to date)."""
    write_fingerprints(cfg, project / FINGERPRINT_DIR)
    md5 = recorded_md5(project)
    found = dvc_status(project)
    return {
        name: _reasons(found[name], _fingerprint_reasons(project, name, md5.get(name)))
        for name in stages.STAGES
        if name in found
    }


def report(stale: dict[str, list[str]]) -> str:
    if not stale:
        return "grpo status: every stage is up to date (code, params, data)"
    lines = [f"grpo status: {len(stale)} stage(s) stale; `dvc repro` reruns them"]
    for name, reasons in stale.items():
        lines += [f"{name}:"] + [f"  {reason}" for reason in reasons]
    fresh = [n for n in stages.STAGES if n not in stale]
    if fresh:
        lines.append(f"up to date: {', '.join(fresh)}")
    return "\n".join(lines)


def run(cfg: Config) -> int:
    """``grpo status`` in the current directory (the project root)."""
    print(report(status(Path.cwd(), cfg)))
    return 0
