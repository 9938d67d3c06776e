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
import linecache
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: the project root on the path, for ``tools.mutation_sites``
    sys.path.insert(0, str(ROOT))

from tools.mutation_sites import mutant_source, sites  # noqa: E402


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
        # What reads the module's source by line (pydantic's field docstrings, ``inspect``, tracebacks) must
        # read the mutant, whose lines (``ast.unparse``'s) are not the file's: an entry without a
        # modification time is never checked against the disk.
        linecache.cache[str(self.path)] = (len(self.source), None, self.source.splitlines(True), str(self.path))
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
