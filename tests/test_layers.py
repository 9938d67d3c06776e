"""The layering of grpo/: every module imports only from its own layer or those below (docs/design.md "Layers"),
and no module imports itself through others (no import circles).

Parsed from the code's own import statements (``ast``, function-level and ``TYPE_CHECKING`` imports
included), so the layering cannot decay silently. Bottom-up:

| rank | layer | modules |
| ---: | --- | --- |
| 0 | root | ``grpo.errors``, ``grpo.config``, ``grpo.paths``, ``grpo.files``, ``grpo.seeding``, ``grpo.locks``, ``grpo.offline``, ``grpo.sources`` |
| 1 | provenance | ``grpo.provenance.*`` (reads code as text; names entry functions as strings) |
| 2 | core | ``grpo.core.*`` (torch and ``grpo.errors`` only) |
| 3 | model | ``grpo.model.*``; inside it ``grpo.model.fast`` (the CPU fast paths) sits below the rest: it imports
no other model module but ``grpo.model.generation`` (the library path it stands in for), and the rest reaches
it through its entry point, the package ``grpo.model.fast``, never its modules |
| 4 | data | ``grpo.data.*`` |
| 5 | rewards | ``grpo.rewards.*`` |
| 6 | train, health | ``grpo.train.*``, ``grpo.health.*`` |
| 7 | checks, eval | ``grpo.checks.*``, ``grpo.eval.*`` |
| 8 | top | ``grpo.cli``, ``grpo.pipeline``, ``grpo.seed_sweep`` |
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

GRPO = Path(__file__).resolve().parents[1] / "grpo"

ROOT_MODULES = ("grpo.errors", "grpo.config", "grpo.paths", "grpo.files", "grpo.seeding", "grpo.locks",
                "grpo.offline", "grpo.sources")
LAYERS: dict[str, int] = {
    **dict.fromkeys(ROOT_MODULES, 0),
    "grpo.provenance": 1,
    "grpo.core": 2,
    "grpo.model": 3,
    "grpo.data": 4,
    "grpo.rewards": 5,
    "grpo.train": 6,
    "grpo.health": 6,
    "grpo.checks": 7,
    "grpo.eval": 7,
    "grpo.cli": 8,
    "grpo.pipeline": 8,
    "grpo.seed_sweep": 8,
}
# Within root, only these directions (errors imports nothing; config may use errors; paths the config).
ROOT_MAY_IMPORT = {
    "grpo.errors": (),
    "grpo.files": (),
    "grpo.seeding": (),
    "grpo.sources": (),
    "grpo.offline": ("grpo.sources",),
    "grpo.locks": ("grpo.errors",),
    "grpo.config": ("grpo.errors", "grpo.offline"),
    "grpo.paths": ("grpo.config",),
}
CORE_THIRD_PARTY = {"torch"}
FAST = "grpo.model.fast"
FAST_MAY_IMPORT = ("grpo.model.generation",)
STAGE_ENTRY_MODULES = ("grpo.data.prepare", "grpo.data.validate", "grpo.train.pretrain", "grpo.train.sft",
                       "grpo.checks.preflight", "grpo.train.trainer", "grpo.eval.evaluate")


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, package_dir: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, at any depth; ``from grpo import paths`` -> grpo.paths."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{alias.name}" if _is_submodule(base, alias.name, package_dir) else base)
                    for alias in node.names]
    return out


def _is_submodule(base: str, name: str, package_dir: Path) -> bool:
    folder = package_dir.parent.joinpath(*base.split("."))
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def layer_of(module: str) -> tuple[str, int] | None:
    """The layer prefix and rank of a project module (longest matching prefix), None outside grpo."""
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        return None
    prefix = max(matches, key=len)
    return prefix, LAYERS[prefix]


def violations(package_dir: Path) -> list[str]:
    """Every import that goes against the layering, as ``file:line: importer -> imported (why)``."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        importer = module_name(path, package_dir)
        own = layer_of(importer)
        if own is None:
            if importer != "grpo":
                found.append(f"{path}: {importer} belongs to no layer; add it to the Layout table")
            continue
        for line, imported in imported_modules(path, package_dir):
            why = _why_not(importer, own, imported)
            if why:
                found.append(f"{path}:{line}: {importer} -> {imported} ({why})")
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _why_not(importer: str, own: tuple[str, int], imported: str) -> str | None:
    top = imported.split(".")[0]
    if _within(imported, FAST) and imported != FAST and not _within(importer, FAST):
        return f"outside grpo/model/fast, import its entry point {FAST}, not its modules"
    if _within(importer, FAST) and _within(imported, "grpo.model") and not _within(imported, FAST) and (
        imported not in FAST_MAY_IMPORT
    ):
        return f"grpo/model/fast imports no model module but {FAST_MAY_IMPORT}: its callers ask it, never the reverse"
    if own[0] == "grpo.core" and top not in ("grpo", *CORE_THIRD_PARTY) and top not in sys.stdlib_module_names:
        return "core imports torch and the standard library only"
    if top in ("prefect", "dvc") or (top == "argparse" and importer != "grpo.cli"):
        return "grpo/ knows nothing of Prefect or DVC, and only grpo/cli.py parses arguments"
    target = layer_of(imported)
    if target is None or imported == "grpo":
        return None
    if own[0] in ROOT_MAY_IMPORT:
        allowed = ROOT_MAY_IMPORT[own[0]]
        within = target[0] == own[0]  # a root package's own modules (grpo.config.*)
        return None if within or target[0] in allowed else f"root module {own[0]} may import only {allowed or 'nothing'}"
    if own[0] == "grpo.core" and target[0] not in ("grpo.core", "grpo.errors"):
        return "core imports grpo.errors only"
    if target[1] > own[1]:
        return f"upward: layer {own[0]} (rank {own[1]}) may not import {target[0]} (rank {target[1]})"
    if target[1] == own[1] and target[0] != own[0] and own[1] == 7:
        return f"{own[0]} and {target[0]} sit side by side and stay apart"
    if importer in STAGE_ENTRY_MODULES and imported in STAGE_ENTRY_MODULES and imported != importer:
        return "a stage module imports another stage module; take paths from grpo.paths"
    return None


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (at any depth)."""
    modules = {module_name(path, package_dir): path for path in package_dir.rglob("*.py")}
    return {
        name: {m for _, m in imported_modules(path, package_dir) if m in modules and m != name}
        for name, path in modules.items()
    }


def circles(package_dir: Path) -> list[list[str]]:
    """The import circles: each set of two or more modules that import one another, directly or through
    others (the strongly connected components of ``import_graph``, Tarjan's algorithm), sorted."""
    edges = import_graph(package_dir)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(edges[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


# --------------------------------------------------------------------------- the real package


def test_every_import_goes_down_the_layers():
    assert violations(GRPO) == []


def test_no_import_circle():
    """No module imports itself through others, not even for type hints (``TYPE_CHECKING``): types two
    modules share live in a third both import (``grpo.train.step_types``, ``grpo.model.engine_types``)."""
    assert circles(GRPO) == []


def test_every_module_belongs_to_a_layer():
    modules = [module_name(path, GRPO) for path in GRPO.rglob("*.py")]
    assert [m for m in modules if m != "grpo" and layer_of(m) is None] == []


def test_data_does_not_import_rewards():
    """One text normalisation (grpo.data.text); rewards build on data, never the other way."""
    back = [(path.name, imported) for path in (GRPO / "data").rglob("*.py")
            for _, imported in imported_modules(path, GRPO) if imported.startswith("grpo.rewards")]
    assert back == []


# --------------------------------------------------------------------------- the checker itself


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "grpo"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return package


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ({"model/chat.py": "from grpo.data.schema import LETTERS\n", "data/schema.py": ""}, "upward"),
        ({"core/losses.py": "def f():\n    from grpo.model import modeling\n", "model/modeling.py": ""},
         "core imports grpo.errors only"),
        ({"core/losses.py": "import numpy\n"}, "core imports torch and the standard library only"),
        ({"data/text.py": "from ..rewards.text import normalize_answer\n", "rewards/text.py": ""}, "upward"),
        ({"train/trainer.py": "from grpo.checks import preflight\n", "checks/preflight.py": ""}, "upward"),
        ({"eval/evaluate.py": "from grpo.checks.diagnose import run\n", "checks/diagnose.py": ""}, "side by side"),
        ({"eval/evaluate.py": "from grpo.train.sft import run\n", "train/sft.py": ""}, "another stage module"),
        ({"provenance/lineage.py": "import grpo.train.step\n", "train/step.py": ""}, "upward"),
        ({"train/trainer.py": "import argparse\n"}, "only grpo/cli.py parses arguments"),
        ({"paths.py": "from grpo.data import schema\n", "data/schema.py": ""}, "root module grpo.paths"),
        ({"newlayer/thing.py": ""}, "belongs to no layer"),
        ({"model/rollout.py": "from grpo.model.fast.decode import decode\n", "model/fast/decode.py": ""},
         "import its entry point grpo.model.fast"),
        ({"model/kernels.py": "from grpo.model.fast import multinomial\n", "model/fast/multinomial.py": ""},
         "import its entry point grpo.model.fast"),
        ({"model/fast/decode.py": "from grpo.model.rollout import Rollout\n", "model/rollout.py": ""},
         "grpo/model/fast imports no model module"),
        ({"model/fast/paths.py": "def f():\n    from grpo.model import precision\n", "model/precision.py": ""},
         "grpo/model/fast imports no model module"),
    ],
)
def test_checker_reports_a_broken_rule(tmp_path, files, fragment):
    found = violations(_package(tmp_path, files))
    assert any(fragment in line for line in found), found


def test_checker_accepts_downward_and_same_layer_imports(tmp_path):
    package = _package(tmp_path, {
        "train/trainer.py": "from grpo.health import monitor\nfrom grpo.core import losses\nfrom grpo import paths\n",
        "health/monitor.py": "from grpo.train import checkpoint\n",
        "train/checkpoint.py": "",
        "core/losses.py": "import math\nimport torch\nfrom grpo.errors import GrpoError\n",
        "rewards/text.py": "from grpo.data.text import normalize_answer\n",
        "data/text.py": "",
        "paths.py": "from grpo.config import Config\n",
        "config.py": "from grpo.errors import GrpoError\n",
        "errors.py": "",
        "cli.py": "import argparse\nfrom grpo.provenance import stages\n",
        "provenance/stages.py": "",
        "model/rollout.py": "from grpo.model.fast import FastPaths\n",
        "model/fast/__init__.py": "from grpo.model.fast.paths import FastPaths\n",
        "model/fast/paths.py": "from grpo.model.fast import decode\nfrom grpo.model import generation\n",
        "model/fast/decode.py": "from grpo.core import losses\nfrom grpo.config import Config\n",
        "model/generation.py": "",
    })
    assert violations(package) == []
    assert circles(package) == []


@pytest.mark.parametrize(
    ("files", "circle"),
    [
        ({"train/step.py": "from grpo.train.update import update\n",
          "train/update.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.train.step import Step\n"},
         ["grpo.train.step", "grpo.train.update"]),
        ({"model/fast/paths.py": "from grpo.model.fast import decode\n",
          "model/fast/decode.py": "from grpo.model.fast import head\n",
          "model/fast/head.py": "def f():\n    from grpo.model.fast.paths import FastPaths\n"},
         ["grpo.model.fast.decode", "grpo.model.fast.head", "grpo.model.fast.paths"]),
    ],
    ids=["type-checking", "through-a-third-module"],
)
def test_checker_finds_a_circle(tmp_path, files, circle):
    assert circles(_package(tmp_path, files)) == [circle]
