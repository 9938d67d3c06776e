"""Mechanical mutation sweep: every small operator change of one module, run against its tests.

The hand-written bug forms (``tests/mutations.py``, docs/experiments/unseen-mutations.md) are the forms
someone thought of. This sweep writes the forms nobody chose: each comparison, arithmetic operator,
boolean connective, number, ``min``/``max``, ``sum``/``mean``, negation and side-effect call of one
module changed one at a time (mutmut's and cosmic-ray's operators, over Python's own AST), and runs the
module's fast tests against each. A mutant whose tests all pass is a survivor: a missing assertion, or
an equivalent change (read it to tell).

    python tools/mutation_sweep.py grpo/core/losses.py tests/test_losses.py [more tests] [--jobs 2]

How it runs quickly: the parent imports the heavy third-party libraries once (torch, transformers, ...)
and never the project; each mutant runs in a forked child whose import of the mutated module is served
the mutant's source by a meta-path finder, so the child imports the rest of the project fresh from disk
and pytest runs in-process. Tests that start subprocesses see the file on disk, not the mutant: a
survivor is confirmed by patching the file itself (``--confirm``) before a test is written for it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
           ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
_CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_NAME_SWAPS = {"min": "max", "max": "min", "any": "all", "all": "any", "amin": "amax", "amax": "amin",
               "sum": "mean", "mean": "sum", "minimum": "maximum", "maximum": "minimum",
               "clamp_min": "clamp_max", "clamp_max": "clamp_min", "argmax": "argmin", "argmin": "argmax",
               "cumsum": "cumprod", "float": "int", "ge": "gt", "gt": "ge", "le": "lt", "lt": "le",
               "logical_and": "logical_or", "logical_or": "logical_and", "exp": "log", "log": "exp"}
_SKIP_CALLS = {"print", "warn", "warning", "info", "debug", "error", "exception", "echo", "log_line"}


class Site(NamedTuple):
    index: int
    line: int
    col: int
    kind: str
    text: str  # what changes, e.g. "< -> <="
    statement: int  # the line of the statement holding it (what coverage records)


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _options(node: ast.AST) -> list[tuple[str, str, callable]]:
    """The mutations of ``node`` itself: (kind, description, apply(node))."""
    out = []
    if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINOPS:
        new = _BINOPS[type(node.op)]
        out.append(("binop", f"{type(node.op).__name__} -> {new.__name__}",
                    lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMPOPS:
                new = _CMPOPS[type(op)]
                out.append(("compare", f"{type(op).__name__} -> {new.__name__}",
                            lambda n, i=i, new=new: n.ops.__setitem__(i, new())))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append(("boolop", f"{type(node.op).__name__} -> {new.__name__}",
                    lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.Not):
        out.append(("unary", f"drop {type(node.op).__name__}", "replace_with_operand"))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        value = node.value
        if isinstance(value, bool):
            new = not value
        elif value == 0:
            new = type(value)(1)
        elif value == 1:
            new = type(value)(0)
        elif isinstance(value, int):
            new = value + 1
        else:
            new = value * 2
        out.append(("number", f"{value!r} -> {new!r}", lambda n, new=new: setattr(n, "value", new)))
    elif isinstance(node, ast.Name) and node.id in _NAME_SWAPS and isinstance(node.ctx, ast.Load):
        new = _NAME_SWAPS[node.id]
        if node.id not in ("float", "sum", "exp", "log"):  # builtins: only the pairs that exist as builtins
            out.append(("name", f"{node.id} -> {new}", lambda n, new=new: setattr(n, "id", new)))
    elif isinstance(node, ast.Attribute) and node.attr in _NAME_SWAPS and isinstance(node.ctx, ast.Load):
        new = _NAME_SWAPS[node.attr]
        out.append(("attr", f".{node.attr} -> .{new}", lambda n, new=new: setattr(n, "attr", new)))
    elif isinstance(node, ast.Break | ast.Continue):
        new = ast.Continue if isinstance(node, ast.Break) else ast.Break
        out.append(("flow", f"{type(node).__name__} -> {new.__name__}", "swap_flow"))
    return out


def _statement_options(stmt: ast.stmt) -> list[tuple[str, str, str]]:
    """Whole-statement mutations: a call made for its effect removed; an ``if``'s test negated."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in _SKIP_CALLS:
            return [("statement", f"drop call {name}()", "drop_statement")]
    if isinstance(stmt, ast.If | ast.While) and not isinstance(stmt.test, ast.Compare | ast.BoolOp | ast.UnaryOp):
        return [("condition", "negate condition", "negate_test")]
    return []


class _Walker:
    """Visits the mutable nodes in a fixed order; applies mutation number ``target`` when given."""

    def __init__(self, target: int | None = None):
        self.target = target
        self.sites: list[Site] = []
        self.applied = False
        self.statement = 0

    def _offer(self, node, parent, field, index, options):
        for kind, text, action in options:
            number = len(self.sites)
            line = getattr(node, "lineno", 0)
            self.sites.append(Site(number, line, getattr(node, "col_offset", 0), kind, text, self.statement or line))
            if number == self.target:
                self._apply(node, parent, field, index, action)
                self.applied = True

    @staticmethod
    def _apply(node, parent, field, index, action):
        def put(new):
            if index is None:
                setattr(parent, field, new)
            else:
                getattr(parent, field)[index] = new
        if action == "replace_with_operand":
            put(node.operand)
        elif action == "swap_flow":
            put(ast.Continue() if isinstance(node, ast.Break) else ast.Break())
        elif action == "drop_statement":
            put(ast.Pass())
        elif action == "negate_test":
            node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
        else:
            action(node)

    def visit(self, node: ast.AST, parent=None, field=None, index=None):
        if isinstance(node, ast.Raise | ast.JoinedStr | ast.Assert | ast.Import | ast.ImportFrom):
            return  # error messages, asserts and imports: not the computation
        if isinstance(node, ast.Expr) and _is_docstring(node, parent):
            return
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _SKIP_CALLS:
                return
        if isinstance(node, ast.stmt):
            self.statement = node.lineno
            self._offer(node, parent, field, index, _statement_options(node))
        self._offer(node, parent, field, index, _options(node))
        statement = self.statement
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        self.visit(item, node, name, i)
            elif isinstance(value, ast.AST):
                self.visit(value, node, name, None)
            self.statement = statement


def sites(source: str) -> list[Site]:
    walker = _Walker()
    walker.visit(ast.parse(source))
    return walker.sites


def mutant_source(source: str, number: int) -> str:
    tree = ast.parse(source)
    walker = _Walker(number)
    walker.visit(tree)
    if not walker.applied:
        raise IndexError(f"no mutation number {number}")
    return ast.unparse(ast.fix_missing_locations(tree))


class _ServeSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``source`` for module ``name``; every other import goes to the normal finders."""

    def __init__(self, name: str, path: Path, source: str):
        self.name, self.path, self.source = name, path, source

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        is_package = self.path.name == "__init__.py"
        spec = importlib.util.spec_from_loader(fullname, self, origin=str(self.path), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = [str(self.path.parent)]
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = str(self.path)
        exec(compile(self.source, str(self.path), "exec"), module.__dict__)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _child(module: str, path: Path, source: str | None, tests: list[str], marker: str) -> None:
    """Runs in the forked child: the mutant served, pytest in-process; exits with pytest's code."""
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import torch

    torch.set_num_threads(1)
    if source is not None:
        sys.meta_path.insert(0, _ServeSource(module, path, source))
    import pytest

    code = pytest.main([*tests, "-x", "-q", "-m", marker, "-p", "no:cacheprovider", "-p", "no:randomly"])
    os._exit(int(code))


def _preload() -> None:
    """The heavy libraries the project's tests import, loaded once in the parent (never the project)."""
    for name in ("torch", "numpy", "transformers", "peft", "accelerate", "safetensors", "tokenizers",
                 "pydantic", "yaml", "pytest", "datasets", "matplotlib", "matplotlib.pyplot"):
        try:
            __import__(name)
        except ImportError:
            pass
    import transformers  # noqa: F401  (models' modules load lazily: touch the ones the project uses)
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401


def covering_tests(coverage_file: Path, target: Path) -> dict[int, list[str]]:
    """Line -> the test node ids that ran it, from a coverage file recorded with per-test contexts
    (``pytest --cov=grpo --cov-context=test``)."""
    import coverage

    data = coverage.CoverageData(basename=str(coverage_file))
    data.read()
    by_line = data.contexts_by_lineno(str(target)) or {}
    out = {}
    for line, contexts in by_line.items():
        ids = sorted({c.rsplit("|", 1)[0] for c in contexts if c})
        if ids:
            out[line] = ids
    return out


def test_seconds(junit: Path) -> dict[str, float]:
    """Node id -> seconds, from a pytest JUnit XML report (``pytest --junitxml``)."""
    import xml.etree.ElementTree as ElementTree

    out = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{module}::{case.get('name')}"] = float(case.get("time", 0))
    return out


def run_sweep(target: Path, tests: list[str], jobs: int, timeout_factor: float, marker: str,
              only: list[int] | None, out: Path | None, coverage_file: Path | None = None,
              junit: Path | None = None) -> list[dict]:
    """Each mutant against ``tests``, or (``coverage_file``) against the tests that ran its statement, with
    ``tests`` for statements no test context ran (those run at import)."""
    source = target.read_text()
    module = _module_name(target)
    all_sites = sites(source)
    chosen = [s for s in all_sites if only is None or s.index in only]
    covering = covering_tests(coverage_file, target) if coverage_file else None
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    _preload()
    every = sorted({t for ids in (covering or {}).values() for t in ids} | set(tests))
    start = time.monotonic()
    base = _run_one(module, target, None, every, marker, timeout=3600)
    base_seconds = time.monotonic() - start
    if base != 0:  # also proves every node id exists: a mutant's usage error (4) is then a collection error
        raise SystemExit(f"the unmutated tests fail (pytest exit {base}): fix them first")
    recorded = test_seconds(junit) if junit else {}

    def timeout_of(chosen_tests: list[str]) -> float:
        known = sum(recorded.get(t, 1.0) for t in chosen_tests) if recorded else base_seconds
        return max(60.0, timeout_factor * known + 30.0)

    print(f"{module}: {len(chosen)} of {len(all_sites)} mutants, {len(every)} tests {base_seconds:.1f} s unmutated",
          flush=True)
    results, running, queue = [], {}, list(chosen)
    lines = source.splitlines()
    while queue or running:
        while queue and len(running) < jobs:
            site = queue.pop(0)
            chosen_tests = tests if covering is None else covering.get(site.statement, tests)
            pid = _fork(module, target, mutant_source(source, site.index), chosen_tests, marker)
            running[pid] = (site, time.monotonic(), len(chosen_tests), timeout_of(chosen_tests))
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            for child, (_, began, _, timeout) in list(running.items()):
                if time.monotonic() - began > timeout:
                    os.killpg(child, signal.SIGKILL)
            continue
        if pid not in running:
            continue
        site, began, n_tests, _ = running.pop(pid)
        seconds = time.monotonic() - began
        if os.WIFSIGNALED(status):
            outcome = "timeout" if os.WTERMSIG(status) == signal.SIGKILL else "killed"
        else:
            code = os.WEXITSTATUS(status)
            # 1: a test failed; 2: collection or import failed (the mutant broke the module); 4: a node id
            # not found, which the unmutated run rules out, so its module failed to collect; 5: none ran
            outcome = {0: "survived", 1: "killed", 2: "killed", 4: "killed", 5: "no tests"}.get(code, f"error{code}")
        row = {**site._asdict(), "outcome": outcome, "seconds": round(seconds, 1), "tests": n_tests,
               "source_line": lines[site.line - 1].strip() if site.line else ""}
        results.append(row)
        if outcome in ("survived", "no tests", "timeout"):
            print(f"  {outcome.upper()} #{site.index} line {site.line}: {site.text}   | {row['source_line']}",
                  flush=True)
    results.sort(key=lambda r: r["index"])
    summary = {o: sum(r["outcome"] == o for r in results) for o in sorted({r["outcome"] for r in results})}
    print(f"{module}: {summary}", flush=True)
    if out is not None:
        out.write_text(json.dumps({"module": module, "tests": tests, "results": results}, indent=1))
    return results


def _fork(module, path, source, tests, marker) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _child(module, path, source, tests, marker)
        finally:
            os._exit(3)
    return pid


def _run_one(module, path, source, tests, marker, timeout) -> int:
    pid = _fork(module, path, source, tests, marker)
    began = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        if time.monotonic() - began > timeout:
            os.killpg(pid, signal.SIGKILL)
        time.sleep(0.05)


def confirm(target: Path, number: int, tests: list[str]) -> int:
    """Patches the file on disk with mutant ``number``, runs the tests in a subprocess, restores the file."""
    original = target.read_text()
    try:
        target.write_text(mutant_source(original, number))
        return subprocess.call([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                               cwd=ROOT)
    finally:
        target.write_text(original)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", type=Path, help="the module to mutate, e.g. grpo/core/losses.py")
    parser.add_argument("tests", nargs="+", help="the test files or node ids to run against each mutant")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (one torch thread each)")
    parser.add_argument("--timeout-factor", type=float, default=4.0,
                        help="a mutant running longer than this times the unmutated tests counts as a timeout")
    parser.add_argument("--marker", default="not slow", help="pytest -m expression (default: the fast tests)")
    parser.add_argument("--only", type=int, nargs="*", help="run only these mutant numbers")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--show", type=int, help="print mutant N's changed line and exit")
    parser.add_argument("--confirm", type=int, help="patch the file with mutant N, run the tests, restore it")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--junit", type=Path, help="a JUnit XML report of the suite: each mutant's timeout "
                        "follows its tests' recorded seconds")
    parser.add_argument("--coverage", type=Path,
                        help="a coverage file with per-test contexts: each mutant runs the tests that ran its line")
    args = parser.parse_args(argv)
    target = args.module.resolve()
    if not target.is_file():
        parser.error(f"no module {args.module}: name a .py file of the project, e.g. grpo/core/losses.py")
    if args.list:
        for site in sites(target.read_text()):
            print(f"#{site.index} line {site.line}:{site.col} {site.kind}: {site.text}")
        return
    if args.show is not None:
        original = ast.unparse(ast.parse(target.read_text())).splitlines()
        mutated = mutant_source(target.read_text(), args.show).splitlines()
        for old, new in zip(original, mutated, strict=False):
            if old != new:
                print(f"- {old.strip()}\n+ {new.strip()}")
        return
    if args.confirm is not None:
        raise SystemExit(confirm(target, args.confirm, args.tests))
    run_sweep(target, args.tests, args.jobs, args.timeout_factor, args.marker, args.only, args.out,
              args.coverage, args.junit)


if __name__ == "__main__":
    main()
