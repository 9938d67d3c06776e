"""Semantic code fingerprints: per stage, a hash of the meaning of the project code it runs.

DVC's own dependency hashes are byte hashes, so a comment edit in ``grpo/model/chat.py`` would retrain
every model. Instead, ``grpo fingerprint`` (an always-run DVC stage) writes
``fingerprints/<stage>.json`` and every other stage depends on its own file: the hash of each module
in the stage's static import closure is taken over its syntax tree, with docstrings dropped and
comments, formatting and line numbers absent by construction. A file is rewritten only when its
content changes, so a comment edit reruns nothing and a semantic edit reruns exactly the stages whose
closure holds the edited module (DESIGN.md "Stale runs are invalidated automatically", point 2).
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.errors import GrpoError
from grpo.files import file_sha256, write_text
from grpo.provenance import stages
from grpo.provenance.file_memo import memo_by_stat

# The folder that holds the ``grpo`` package: the code that is running is the code fingerprinted.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT_DIR = Path("fingerprints")
HISTORY_DIR = "history"
"""``fingerprints/history/<md5>.json``: every version written, by the md5 DVC records in dvc.lock, so
``grpo status`` can name the modules that changed since a stage last ran."""

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class FingerprintError(GrpoError):
    """A project module cannot be parsed, so its meaning cannot be hashed."""


# --------------------------------------------------------------------------- semantic hash


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, _DOCSTRING_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            node.body = node.body[1:]


def _canonical(node: Any) -> str:
    """A dump of the tree that is the same on Python 3.11-3.13.

    ``ast.dump`` changed format across versions (3.12 added ``type_params``, 3.13 hides empty
    fields), which would flip every fingerprint when a machine upgrades Python; empty and ``None``
    fields are therefore always left out, and attributes (line numbers) never written.
    """
    if isinstance(node, ast.AST):
        fields = (
            f"{name}={_canonical(value)}"
            for name, value in ast.iter_fields(node)
            if value is not None and value != []
        )
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def semantic_hash(source: str, filename: str = "<string>") -> str:
    """sha256 of the module's syntax tree without docstrings; comments and layout never reach it."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise FingerprintError(
            f"{filename}: cannot be parsed (line {exc.lineno}: {exc.msg}); fix the syntax error, "
            "then rerun `grpo fingerprint`"
        ) from None
    _strip_docstrings(tree)
    return hashlib.sha256(_canonical(tree).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- import closure


def module_file(name: str, root: Path) -> Path | None:
    """The file of module ``name`` under ``root`` (``a/b/__init__.py`` or ``a/b.py``: where both exist, the
    package, as Python's import does), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_name(base.name + ".py")):
        if candidate.is_file():
            return candidate
    return None


def _relative_base(module: str, is_package: bool, level: int) -> str | None:
    """The package a ``from .{level}`` import is relative to; None when it climbs past the top."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        return None
    return ".".join(parts[: len(parts) - (level - 1)])


def imported_names(source: str, module: str, is_package: bool, filename: str = "<string>") -> set[str]:
    """Every module name the source may import, at any depth (imports inside functions count).

    ``from x import y`` yields both ``x`` and ``x.y``: ``y`` may be a submodule, and a name that is
    not a module simply resolves to no file.
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise FingerprintError(f"{filename}: cannot be parsed (line {exc.lineno}: {exc.msg})") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _relative_base(module, is_package, node.level)
                if base is None:
                    continue
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return {name for name in names if name}


def _file_imports(path: Path, module: str) -> tuple[str, ...]:
    """``imported_names`` of the module file ``path`` (``memo_by_stat`` keeps it per file version)."""
    source = path.read_text(encoding="utf-8")
    return tuple(sorted(imported_names(source, module, path.name == "__init__.py", str(path))))


def _file_hash(path: Path) -> str:
    """``semantic_hash`` of the module file ``path`` (``memo_by_stat`` keeps it per file version)."""
    return semantic_hash(path.read_text(encoding="utf-8"), str(path))


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: importing a module runs its packages' ``__init__.py``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_closure(
    entry_modules: Iterable[str],
    package_root: Path,
    packages: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[Path]:
    """Sorted files of the project modules reachable from ``entry_modules`` by static imports.

    Only modules whose top-level package is in ``packages`` (default: the entries' own top-level
    packages) are followed; a module that does not exist (yet) is skipped, not an error; a module
    in ``exclude``, or inside a package in it, is neither included nor followed.
    """
    entries = list(entry_modules)
    root = Path(package_root)
    allowed = set(packages) if packages is not None else {name.split(".")[0] for name in entries}
    excluded = tuple(exclude)
    seen: set[str] = set()
    files: set[Path] = set()
    queue = entries
    while queue:
        name = queue.pop()
        if (
            name in seen
            or name.split(".")[0] not in allowed
            or any(name == package or name.startswith(package + ".") for package in excluded)
        ):
            continue
        seen.add(name)
        queue.extend(_ancestors(name))
        path = module_file(name, root)
        if path is None:
            continue
        files.add(path)
        queue.extend(memo_by_stat("imports", path, _file_imports, name))
    return sorted(files)


# --------------------------------------------------------------------------- per stage


def stage_fingerprint(stage: str, root: Path | None = None) -> dict[str, Any]:
    """``{stage, modules: {relpath: hash}, fingerprint}`` of the code ``stage`` runs now."""
    root = Path(root) if root is not None else PROJECT_ROOT
    spec = stages.get_stage(stage)
    modules = {
        path.relative_to(root).as_posix(): memo_by_stat("semantic", path, _file_hash)
        for path in import_closure(spec.entry_modules, root, exclude=stages.BOOKKEEPING_MODULES)
    }
    combined = hashlib.sha256(
        "".join(f"{relpath}:{digest}\n" for relpath, digest in sorted(modules.items())).encode("utf-8")
    ).hexdigest()
    return {"stage": stage, "modules": modules, "fingerprint": combined}


def raw_data_fingerprint(cfg: Config) -> dict[str, dict[str, str]]:
    """``{"data.<task>_path": {file: sha256}}`` of the published dataset files the prepare stage reads:
    the file ``data.<task>_path`` names, or every file directly in that folder, for each task whose
    source is not synthetic (a missing path gives ``{}``: prepare itself then fails naming it). Kept in
    ``fingerprints/prepare.json``, so an edited, added or removed raw file reruns prepare and what
    follows; with both sources synthetic the file holds no such key and reads as before."""
    found: dict[str, dict[str, str]] = {}
    for task in ("fairness", "hallucination"):
        if getattr(cfg.data, f"{task}_source") == "synthetic":
            continue
        path = Path(getattr(cfg.data, f"{task}_path"))
        if path.is_dir():
            listed = sorted(p for p in path.iterdir() if p.is_file())
        else:
            listed = [path] if path.is_file() else []
        found[f"data.{task}_path"] = {file.as_posix(): file_sha256(file) for file in listed}
    return found


def _write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds it (its mtime then stays); True if written."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    write_text(path, text)
    return True


def write_fingerprints(cfg: Config, out_dir: Path = FINGERPRINT_DIR, root: Path | None = None) -> list[str]:
    """Write ``<out_dir>/<stage>.json`` for every stage (prepare's with ``raw_data_fingerprint(cfg)``);
    return the stages whose file changed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    raw = raw_data_fingerprint(cfg)
    for name in stages.STAGES:
        found = stage_fingerprint(name, root) | ({"raw_data": raw} if name == "prepare" and raw else {})
        text = json.dumps(found, indent=2, sort_keys=True) + "\n"
        if _write_if_changed(out_dir / f"{name}.json", text):
            changed.append(name)
        _write_if_changed(history_path(out_dir, text), text)
    return changed


def history_path(out_dir: Path, text: str) -> Path:
    """Where the fingerprint file with content ``text`` is kept: named by its md5, as in dvc.lock."""
    history = Path(out_dir) / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    return history / f"{hashlib.md5(text.encode('utf-8')).hexdigest()}.json"


def run(cfg: Config) -> int:
    """``grpo fingerprint``: refresh ``fingerprints/*.json`` in the current directory."""
    changed = write_fingerprints(cfg, FINGERPRINT_DIR)
    for name, spec in stages.STAGES.items():
        absent = [m for m in spec.modules if module_file(m, PROJECT_ROOT) is None]
        state = "changed" if name in changed else "unchanged"
        note = f" (not written yet: {', '.join(absent)})" if absent else ""
        print(f"fingerprint: {name} {state}{note}")
    return 0
