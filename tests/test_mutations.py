"""Mutation testing: every bug class of docs/invariants.md placed in the stage code fails the tests AND the gate.

One project copy gets data, a base, an SFT model and a passing pre-flight (tiny params, ``reward_only``
so the I7 mutation's gradient mode is the configured one, SFT long enough that its model ends its
answers). Each mutation of ``tests/mutations.py`` is applied to a clone of it; one subprocess in the
clone (its own code first on the path) rebuilds the base and SFT models when the patch is in the SFT
stage (whose code the base stage's pretraining runs too, so the base would be stale), runs ``grpo
preflight`` and then the named tests. Both must fail, and the pre-flight report must name the check
docs/invariants.md says kills the mutation; a patch of the trainer's own wiring (no check named) must
instead make the unpatched code's passing report stale, so ``grpo train`` refuses to start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.dvc_stage import stage_env
from tests.mutations import MUTATIONS, Mutation
from tests.project_copy import ROOT, copy_project

pytestmark = pytest.mark.slow

# grpo.bf16 as params.yaml ships it: the gate runs the step's bf16 path with its bf16 bounds (fp32 on a
# CPU without native bf16), and must still catch every injected bug.
# SFT long enough that the model learns to stop, so the gate holds it to preflight.min_ended_share's default.
PARAMS = {"grpo": {"bf16": True, "multitask": {"mode": "cagrad", "reward_only": True}},
          "data": {"n_train": 32}, "sft": {"epochs": 8, "lr": 0.005}, "preflight": {"min_ended_share": 0.5}}

DRIVER = """
import json, sys
import pytest
from grpo.cli import main
from grpo.config import load_config
from grpo.provenance.gate import PreflightError, require_preflight
retrain, stale, tests = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"sft": (main(["base"]) or main(["sft"])) if retrain else 0}
if stale:  # the unpatched code's passing report must no longer count
    try:
        require_preflight(load_config())
        out["stale"] = ""
    except PreflightError as error:
        out["stale"] = str(error)
else:
    out["preflight"] = main(["preflight"])
out["tests"] = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *tests]))
print("MUTANT " + json.dumps(out))
"""


def run_in(project: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=project, env=stage_env(project), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The project copy with data, base and SFT model built by its own (unmutated) code, tests included."""
    project = copy_project(tmp_path_factory.mktemp("mutations") / "project", PARAMS)
    shutil.copytree(ROOT / "tests", project / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    stages = ("from grpo.cli import main; import sys; "
              "sys.exit(max(main([s]) for s in ('prepare', 'base', 'sft', 'preflight')))")
    proc = run_in(project, "-c", stages)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return project


def mutate(project: Path, mutation: Mutation) -> None:
    path = project / mutation.path
    text = path.read_text(encoding="utf-8")
    assert text.count(mutation.old) == 1, f"{mutation.name}: the patched line is gone from {mutation.path}"
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")


def test_every_patched_line_is_still_in_the_code():
    """The table tracks the code: a refactor that moves a patched line must update the mutation."""
    for mutation in MUTATIONS:
        assert (ROOT / mutation.path).read_text(encoding="utf-8").count(mutation.old) == 1, mutation.name


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_fails_the_tests_and_the_preflight(built, tmp_path, mutation):
    project = shutil.copytree(built, tmp_path / "mutant", symlinks=True)
    mutate(project, mutation)
    proc = run_in(project, "-c", DRIVER, json.dumps(mutation.retrain_sft), json.dumps(mutation.check is None),
                  json.dumps(list(mutation.tests)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MUTANT ")]
    assert lines, f"{mutation.name}: the driver did not finish:\n{proc.stdout[-6000:]}"
    result = json.loads(lines[-1].removeprefix("MUTANT "))
    assert result["sft"] == 0, f"{mutation.name}: the base and SFT rebuild failed:\n{proc.stdout[-4000:]}"
    assert result["tests"] == 1, f"{mutation.name} survived the tests {mutation.tests}:\n{proc.stdout[-4000:]}"
    if mutation.check is None:
        assert "code_fingerprint" in result["stale"], f"{mutation.name} left the gate's report valid: {result}"
        return
    assert result["preflight"] != 0, f"{mutation.name} survived grpo preflight:\n{proc.stdout[-4000:]}"
    report = json.loads((project / "reports" / "preflight.json").read_text())
    failed = {c["name"]: c["invariant"] for c in report["checks"] if not c["passed"]}
    assert mutation.check in failed, f"{mutation.name}: {mutation.check} passed (failed: {sorted(failed)})"
    assert mutation.invariant in failed[mutation.check], (
        f"{mutation.name}: {mutation.check} failed under {failed[mutation.check]!r}, not {mutation.invariant}"
    )
