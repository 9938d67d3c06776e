"""Lineage guard: every model or checkpoint folder says which code, params and inputs built it.

``lineage.json`` records the stage, its semantic code fingerprint with the hash of every module
(so a mismatch can name the module), the values of the params keys the stage reads (so a mismatch
can name the key and both values) and the content hash of every input. Loading a folder whose
lineage no longer matches the current code, params and inputs raises ``StaleArtifactError`` saying
what changed and how to rebuild; resume uses ``is_stale`` to refuse a checkpoint written by other
code and start fresh (DESIGN.md "Stale runs are invalidated automatically", point 3).
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from grpo.config import Config, config_to_dict
from grpo.errors import GrpoError
from grpo.files import write_json
from grpo.provenance import stages
from grpo.provenance.file_memo import file_sha256_memo
from grpo.provenance.fingerprint import stage_fingerprint

LINEAGE_FILE = "lineage.json"

# Keys that name or place a run's outputs, or record it elsewhere: they are in the stage's params for
# DVC (an output path or a W&B run name changes), but they never change what a stage computes, and
# an artifact moved to a new folder or a run renamed is still the same artifact. `checkpoint` too: how
# often GRPO's state is saved, how many are kept and whether a rerun resumes (bit-exactly) never change
# the weights, so a new `checkpoint.every` neither restarts the run from step 0 nor refuses models/grpo.
NAMING_KEYS = ("experiment", "paths", "tracking", "checkpoint")

_ABSENT = "<absent>"


class StaleArtifactError(GrpoError):
    """An artifact was built by other code, params or inputs than the current ones (or says nothing)."""


class MissingInputError(GrpoError):
    """An input of a stage does not exist, so its content cannot be hashed."""


# --------------------------------------------------------------------------- hashes


def _json_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _is_naming(key: str) -> bool:
    return any(key == name or key.startswith(name + ".") for name in NAMING_KEYS)


def lineage_keys(stage: str) -> tuple[str, ...]:
    """The params keys of ``stage`` that lineage compares (its params minus ``NAMING_KEYS``)."""
    return tuple(key for key in stages.get_stage(stage).params if not _is_naming(key))


def params_values(cfg: Config, stage: str) -> dict[str, Any]:
    """``{key: value}`` of the params ``stage`` reads; a key the config does not have yet is None."""
    tree = config_to_dict(cfg)
    return {key: stages.lookup(tree, key)[1] for key in lineage_keys(stage)}


def params_hash(cfg: Config, stage: str) -> str:
    """Hash of the values of the params keys ``stage`` reads."""
    return _json_hash(params_values(cfg, stage))


def dir_hash(path: Path) -> str:
    """Content hash of a file, or of a folder (sorted relative paths + file sha256).

    Every ``lineage.json`` is left out: it records when and how, not what, and writing it after the
    weights must not change the hash a downstream stage recorded.
    """
    path = Path(path)
    if path.is_file():
        return file_sha256_memo(path)
    if not path.is_dir():
        raise MissingInputError(f"{path} does not exist: run the stage that writes it first (`dvc repro`)")
    digest = hashlib.sha256()
    files = [
        Path(folder) / name for folder, _, names in os.walk(path) for name in names if name != LINEAGE_FILE
    ]
    for file in sorted(files, key=lambda f: f.relative_to(path).as_posix()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{file_sha256_memo(file)}\n".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- write


def make_lineage(
    stage: str, cfg: Config, inputs: dict[str, Path], root: Path | None = None
) -> dict[str, Any]:
    """The lineage of an artifact ``stage`` builds now from ``inputs`` (``root``: code location)."""
    code = stage_fingerprint(stage, root)
    return {
        "stage": stage,
        "code_fingerprint": code["fingerprint"],
        "modules": code["modules"],
        "params_hash": params_hash(cfg, stage),
        "params": params_values(cfg, stage),
        "inputs": {name: dir_hash(path) for name, path in sorted(inputs.items())},
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_lineage(directory: Path, lineage: dict[str, Any]) -> Path:
    """Write ``<directory>/lineage.json`` atomically; return its path."""
    return write_json(Path(directory) / LINEAGE_FILE, lineage, sort_keys=True)


def read_lineage(directory: Path) -> dict[str, Any] | None:
    """The recorded lineage of ``directory``, or None when it has none (or an unreadable one: not JSON, or
    JSON that is not an object)."""
    path = Path(directory) / LINEAGE_FILE
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return found if isinstance(found, dict) else None


# --------------------------------------------------------------------------- check


def _code_changes(recorded: dict[str, Any], current: dict[str, Any], where: str) -> list[str]:
    old, new = recorded.get("modules") or {}, current["modules"]
    lines = [
        f"{m} changed since {where} was built" for m in sorted(old.keys() & new.keys()) if old[m] != new[m]
    ]
    lines += [
        f"{m} is now part of the stage's code (it was not when {where} was built)"
        for m in sorted(new.keys() - old.keys())
    ]
    lines += [f"{m} is no longer part of the stage's code" for m in sorted(old.keys() - new.keys())]
    if not lines and recorded.get("code_fingerprint") != current["fingerprint"]:
        lines.append(f"the code fingerprint of stage {current['stage']} changed since {where} was built")
    return lines


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(_leaves(child, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def _params_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    old, new = {}, {}
    for key, value in (recorded.get("params") or {}).items():
        old.update(_leaves(value, key))
    for key, value in current.items():
        new.update(_leaves(value, key))
    lines = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before != after:
            lines.append(f"params {key}: {json.dumps(before)} -> {json.dumps(after)}")
    return lines


def _input_changes(recorded: dict[str, Any], inputs: dict[str, Path], where: str) -> list[str]:
    old = recorded.get("inputs") or {}
    lines = []
    for name, path in sorted(inputs.items()):
        try:
            digest = dir_hash(path)
        except MissingInputError:
            lines.append(f"input {name} ({path}) no longer exists")
            continue
        if name not in old:
            lines.append(f"input {name} ({path}) was not recorded when {where} was built")
        elif old[name] != digest:
            lines.append(f"input {name} ({path}) changed since {where} was built")
    lines += [
        f"input {name} was recorded but is no longer an input" for name in sorted(old.keys() - inputs.keys())
    ]
    return lines


def _rebuild_hint(stage: str) -> str:
    command = stages.STAGES[stage].command if stage in stages.STAGES else stage
    return f"Rebuild it: `dvc repro {stage}` (or `grpo {command}`)."


def is_stale(
    directory: Path, stage: str, cfg: Config, inputs: dict[str, Path], root: Path | None = None
) -> str | None:
    """Why ``directory`` may not be used by current code and params, or None when its lineage matches."""
    where = str(directory)
    recorded = read_lineage(directory)
    if recorded is None:
        state = "has no readable lineage.json" if Path(directory).is_dir() else "does not exist"
        return f"{where} {state}: nothing says which code, params and inputs built it. {_rebuild_hint(stage)}"
    reasons = []
    if recorded.get("stage") != stage:
        reasons.append(f"it was written by stage {recorded.get('stage')!r}, not {stage!r}")
    reasons += _code_changes(recorded, stage_fingerprint(stage, root), where)
    reasons += _params_changes(recorded, params_values(cfg, stage))
    reasons += _input_changes(recorded, inputs, where)
    if not reasons:
        return None
    bullets = "\n".join(f"  - {reason}" for reason in reasons)
    return f"{where} is stale (built by other code, params or inputs than the current ones):\n{bullets}\n{_rebuild_hint(stage)}"


def check_lineage(
    directory: Path, stage: str, cfg: Config, inputs: dict[str, Path], root: Path | None = None
) -> None:
    """Raise ``StaleArtifactError`` naming every change when ``directory``'s lineage does not match."""
    reason = is_stale(directory, stage, cfg, inputs, root)
    if reason is not None:
        raise StaleArtifactError(reason)
