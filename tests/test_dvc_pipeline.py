"""dvc.yaml: agrees with the stage table, and real `dvc repro` reruns exactly what a change touches.

The fast test reads dvc.yaml through DVC itself (templating resolved) and checks it against
grpo/provenance/stages.py. The slow ones copy the project into a throwaway git repo with tiny params and run
real DVC: one full repro, then partial ones after a comment edit, a semantic edit and a params edit.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from grpo.cli import COMMANDS
from grpo.eval.keymetrics import read_key_metrics
from grpo.eval.verdict import VERDICTS
from grpo.provenance import stages
from grpo.provenance.fingerprint import import_closure
from tasks.workspace import run_folder
from tests.browser import CHROMIUM, browser
from tests.project_copy import ROOT, clone, dvc, missing_stage_modules, stages_run, write_params

pytest.importorskip("dvc")
from dvc.dependency.param import ParamsDependency  # noqa: E402
from dvc.repo import Repo  # noqa: E402

DATA_STAGES = ("prepare", "validate")  # base pretrains with the SFT loop: a loss edit retrains it


def dvc_stages(root: Path = ROOT) -> dict:
    """``{name: dvc Stage}`` of root/dvc.yaml, templating resolved by DVC."""
    with Repo(str(root)) as repo:
        return {stage.name: stage for stage in repo.index.stages}


def _file_deps(stage) -> list[PurePosixPath]:
    return [PurePosixPath(dep.def_path) for dep in stage.deps if not isinstance(dep, ParamsDependency)]


def _params(stage) -> set[str]:
    return {key for dep in stage.deps if isinstance(dep, ParamsDependency) for key in dep.params}


def _inside(path: PurePosixPath, out: PurePosixPath) -> bool:
    return path == out or out in path.parents


def _producer(path: PurePosixPath, by_stage: dict) -> str | None:
    for name, stage in by_stage.items():
        if any(_inside(path, PurePosixPath(out.def_path)) for out in stage.outs):
            return name
    return None


def test_dvc_yaml_matches_stage_table():
    by_stage = dvc_stages()
    assert set(by_stage) == {"fingerprint", *stages.STAGES}
    fp = by_stage["fingerprint"]
    assert fp.cmd == "grpo fingerprint" and fp.always_changed
    assert {o.def_path for o in fp.outs} == {f"fingerprints/{name}.json" for name in stages.STAGES}
    assert not any(o.use_cache for o in fp.outs)
    for name, spec in stages.STAGES.items():
        stage = by_stage[name]
        assert spec.command in COMMANDS
        assert stage.cmd == f"grpo {spec.command}", name
        assert _params(stage) == set(spec.params), f"{name}: dvc.yaml params differ from grpo/provenance/stages.py"
        deps = _file_deps(stage)
        assert PurePosixPath(f"fingerprints/{name}.json") in deps, name
        assert not any(d.suffix == ".py" or d.parts[0] == "grpo" for d in deps), f"{name}: code dep"
        producers = {_producer(d, by_stage) for d in deps} - {"fingerprint"}
        assert producers == set(spec.upstream), f"{name}: dvc.yaml upstream {producers} != table {spec.upstream}"


def test_every_stage_param_is_in_params_yaml():
    """DVC refuses to run a stage whose params key params.yaml lacks, even where the config has a default."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    for name, spec in stages.STAGES.items():
        for key in spec.params:
            node = params
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{name}: params.yaml has no {key}"
                node = node[part]


def test_outputs_cached_and_metrics_not():
    by_stage = dvc_stages()
    for stage in by_stage.values():
        for out in stage.outs:
            if out.metric or out.plot:
                assert not out.use_cache, f"{stage.name}: {out.def_path} must have cache: false"
    cached = {o.def_path for s in by_stage.values() for o in s.outs if o.use_cache}
    assert cached == {"data/processed", "models/base", "models/sft", "models/grpo"}
    metrics = {o.def_path for s in by_stage.values() for o in s.outs if o.metric}
    assert metrics == {f"metrics/key/{name}" for name in ("validate", "sft", "preflight", "grpo", "evaluate")}


# --------------------------------------------------------------------------- real DVC

needs_all_stages = pytest.mark.skipif(
    bool(missing_stage_modules()), reason=f"stage modules not written yet: {', '.join(missing_stage_modules())}"
)


@pytest.fixture
def project(built_project, tmp_path):
    """A private clone of the session's built tiny project (conftest.py ``built_project``)."""
    return clone(built_project, tmp_path / "project")


def _downstream(names: set[str]) -> set[str]:
    out = set(names)
    while True:
        more = {n for n, spec in stages.STAGES.items() if set(spec.upstream) & out} - out
        if not more:
            return out
        out |= more


def _touching(project: Path, relpath: str) -> set[str]:
    """Stages whose import closure holds ``relpath`` (what a semantic edit there must rerun)."""
    return {n for n, spec in stages.STAGES.items()
            if project / relpath in import_closure(spec.entry_modules, project)}


def _covers(listed: str, key: str) -> bool:
    """Whether a params entry of dvc.yaml (a key or a section) covers the dotted ``key``."""
    return key == listed or key.startswith(listed + ".")


def grpo_status(project: Path) -> str:
    """The output of `grpo status` run in ``project`` (the command the docs show)."""
    from tasks.dvc_stage import stage_env

    proc = subprocess.run([sys.executable, "-m", "grpo.cli", "status"], cwd=project, env=stage_env(project),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def _status(project: Path) -> dict:
    return json.loads(dvc(project, "status", "--json").stdout or "{}")


def _changed_deps(status: dict, stage: str) -> dict:
    """``{dep: "modified" | {param: "modified"}}`` of one stage in `dvc status --json`."""
    return {k: v for entry in status.get(stage, []) if isinstance(entry, dict)
            for k, v in entry.get("changed deps", {}).items()}


@pytest.mark.slow
@needs_all_stages
def test_load_sft_refuses_model_after_chat_change(project):
    """A semantic edit in grpo/model/chat.py makes the trained models stale: loading SFT raises, naming
    the base model under it first (the base stage pretrains on chat-rendered records too)."""
    chat = project / "grpo" / "model" / "chat.py"
    chat.write_text(chat.read_text(encoding="utf-8") + "\n_SEMANTIC_PROBE = 1\n", encoding="utf-8")
    code = ("from grpo.config import load_config\nfrom grpo.model.stage_models import load_sft\n"
            "try:\n    load_sft(load_config())\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n    raise SystemExit(3)\n")
    from tasks.dvc_stage import stage_env

    proc = subprocess.run([sys.executable, "-c", code], cwd=project, env=stage_env(project),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.startswith("StaleArtifactError"), proc.stdout
    assert "grpo/model/chat.py changed since models/base was built" in proc.stdout, proc.stdout
    assert "dvc repro base" in proc.stdout, proc.stdout


@pytest.mark.slow
@needs_all_stages
def test_repro_reruns_exactly_what_changed(project):
    """Up to date: nothing; comment: nothing; semantic edit or params edit: what reads it, and why."""
    again = dvc(project, "repro")
    assert stages_run(again.stdout) == {"fingerprint"}, again.stdout
    assert set(_status(project)) <= {"fingerprint"}  # always_changed is the only thing ever "changed"
    assert grpo_status(project) == "grpo status: every stage is up to date (code, params, data)"

    losses = project / "grpo" / "core" / "losses.py"
    original = losses.read_text(encoding="utf-8")
    losses.write_text(original + "\n# a comment changes no meaning\n", encoding="utf-8")
    comment = dvc(project, "repro")
    assert stages_run(comment.stdout) == {"fingerprint"}, comment.stdout

    losses.write_text(original + "\n_SEMANTIC_PROBE = 1\n", encoding="utf-8")
    touched = _touching(project, "grpo/core/losses.py")
    assert {"base", "preflight", "grpo"} <= touched  # base pretrains with the SFT loop, which uses losses.py
    told = grpo_status(project)  # no `dvc repro fingerprint` first: grpo status refreshes them itself
    for name in touched:
        assert f"{name}:\n  code changed (grpo/core/losses.py)" in told, told
    assert "up to date: prepare, validate" in told, told
    dvc(project, "repro", "fingerprint")
    why = _status(project)
    for name in touched:  # `dvc status` says why: the stage's own fingerprint file changed
        assert _changed_deps(why, name).get(f"fingerprints/{name}.json") == "modified", why
    semantic = stages_run(dvc(project, "repro").stdout)
    assert touched <= semantic <= _downstream(touched) | {"fingerprint"}, semantic
    assert {"preflight", "grpo", "evaluate"} <= semantic and not semantic & set(DATA_STAGES), semantic

    params = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    coef = params["grpo"]["lr"] * 2  # a learning rate: the pre-flight checks do not read it
    write_params(project, {"grpo": {"lr": coef}})
    key = "grpo.lr"
    readers = {n for n, spec in stages.STAGES.items() if any(_covers(k, key) for k in spec.params)}
    why = _status(project)
    assert set(why) - {"fingerprint"} == readers, why
    told = grpo_status(project)
    assert all(f"{name}:\n  params.yaml: grpo modified" in told for name in readers), told
    for name in readers:  # status names the changed section, `dvc params diff` the exact key
        changed = _changed_deps(why, name)["params.yaml"]
        assert changed and all(_covers(k, key) and v == "modified" for k, v in changed.items()), why
    diff = json.loads(dvc(project, "params", "diff", "--json").stdout)
    assert diff["params.yaml"][key]["new"] == pytest.approx(coef), diff
    rerun = stages_run(dvc(project, "repro").stdout)
    assert readers == {"grpo", "evaluate"}, readers
    assert rerun - {"fingerprint"} == {"grpo", "evaluate"}, rerun
    assert set(_status(project)) <= {"fingerprint"}

    # A new GRPO adapter reruns what applies it, never the pretraining (BASE_MODEL_KEYS).
    rank = params["model"]["lora"]["r"]
    write_params(project, {"model": {"lora": {"r": rank * 2}}})
    why = _status(project)
    assert set(why) - {"fingerprint"} == {"sft", "preflight", "grpo", "evaluate"}, why
    write_params(project, {"model": {"lora": {"r": rank}}})
    assert set(_status(project)) <= {"fingerprint"}


@pytest.mark.slow
@needs_all_stages
def test_metrics_are_small_and_plots_render_offline(project):
    """`dvc metrics show` fits 120 columns and `dvc metrics diff` 100 (one small file per number);
    `dvc plots show` needs no network."""
    key = read_key_metrics(project / "metrics" / "key" / "evaluate")
    assert {"fairness/s_amb", "hallucination/exact_match"} <= set(key) and set(key["fairness/s_amb"]) == {
        "base", "sft", "grpo"}
    verdicts = {name: key.pop(name) for name in list(key) if name.startswith("verdict/")}
    assert {f"verdict/greedy/{task}" for task in ("fairness", "hallucination")} <= set(verdicts), verdicts
    assert set(verdicts.values()) <= set(VERDICTS), verdicts
    assert all(isinstance(v, int | float | bool) or v is None for row in key.values() for v in row.values()), key
    show = dvc(project, "metrics", "show").stdout
    assert max(len(line) for line in show.splitlines()) <= 120, show
    assert "metrics/key/grpo/reward.json" in show and "pretrain" not in show, show  # only metrics/key/
    diff = dvc(project, "metrics", "diff", "--all").stdout  # HEAD has none: every key row, as new
    assert "metrics/key/evaluate/hallucination/over_abstention_rate.json" in diff, diff
    assert "process_weight_digests" not in diff, diff
    assert max(len(line) for line in diff.splitlines()) <= 100, diff

    dvc(project, "plots", "show", "--out", "dvc_plots")
    html = (project / "dvc_plots" / "index.html").read_text(encoding="utf-8")
    assert "<script" not in html and not re.search(r"(src|href)=[\"']?https?://", html), html[:2000]
    images = re.findall(r"<img[^>]+src=\"([^\"]+)\"", html)
    assert len(images) == 2 and all((project / "dvc_plots" / src).is_file() for src in images), images
    if CHROMIUM is not None:  # and a browser with no network shows both
        with browser() as page:
            page.goto((project / "dvc_plots" / "index.html").as_uri())
            loaded = "[...document.images].filter(i => i.complete && i.naturalWidth > 0).length"
            # wait_for returns at the first truthy value: wait for both images, not for the first of them
            page.wait_for(f"{loaded} >= 2")
            assert page.evaluate(loaded) == 2


@pytest.mark.slow
@needs_all_stages
def test_the_write_locks_sit_beside_the_outputs_and_leave_dvc_and_git_clean(project):
    """Each stage's lock file is beside the folder it guards (grpo/locks.py), never in a DVC output:
    after a full `dvc repro` they are there, DVC finds nothing stale and git lists none of them."""
    locks = {p.relative_to(project).as_posix() for p in project.rglob(".*.lock")}
    assert {"data/.processed.lock", "models/.base.lock", "models/.sft.lock", "models/.grpo.lock",
            "runs/.default.lock", ".metrics.lock", ".reports.lock"} <= locks, locks
    assert set(_status(project)) <= {"fingerprint"}
    listed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert not [line for line in listed if PurePosixPath(line[3:]).name in {PurePosixPath(p).name for p in locks}]


@pytest.mark.slow
@needs_all_stages
def test_dvc_metrics_work_in_every_workspace_a_profile_creates(project):
    """A profile's workspace is a git repository: `dvc metrics diff` there compares with the last run."""
    for profile in sorted((project / "configs").glob("*.yaml")):
        workspace = run_folder(project, profile)
        shown = dvc(workspace, "metrics", "diff")  # no run yet: nothing to compare, and no error
        assert "Only supported for Git repositories" not in shown.stdout, (profile, shown.stdout)
    (project / "configs" / "seven.yaml").write_text("extends: ../params.yaml\nseed: 7\n", encoding="utf-8")
    workspace = run_folder(project, project / "configs" / "seven.yaml")
    dvc(workspace, "repro", "validate")
    show = dvc(workspace, "metrics", "show").stdout
    assert "metrics/key/validate/rows.json" in show and max(map(len, show.splitlines())) <= 120, show
    diff = dvc(workspace, "metrics", "diff").stdout  # the first run against the workspace's first commit
    assert re.search(r"metrics/key/validate/rows\.json\s+value\s+-\s+\d+", diff), diff
    assert run_folder(project, project / "configs" / "seven.yaml") == workspace  # the next run commits it
    again = dvc(workspace, "metrics", "diff").stdout  # nothing changed since (stages not run yet: a warning)
    assert "metrics/key/" not in again, again
