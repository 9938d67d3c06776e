"""grpo/provenance/fingerprint.py: the static import closure of a stage's code, the writer that reruns exactly
the stages a change touches, its history copies, and the raw data files a stage reads (the hash of one
module: tests/test_fingerprint_hash.py)."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path

import pytest

from grpo.config import Config, config_from_dict
from grpo.provenance import fingerprint, stages
from grpo.provenance.fingerprint import (
    HISTORY_DIR,
    history_path,
    import_closure,
    stage_fingerprint,
    write_fingerprints,
)
from grpo.provenance.stages import StageSpec

ROOT = Path(fingerprint.__file__).resolve().parents[2]


def _write(root: Path, relpath: str, source: str) -> Path:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- import_closure


@pytest.fixture
def toy_tree(tmp_path):
    """pkg: from-imports, relative imports, a lazy import, a sub-package, and modules left out."""
    _write(tmp_path, "pkg/__init__.py", "")
    _write(tmp_path, "pkg/main.py", "import os\nfrom pkg.helper import helper\nfrom pkg.sub import leaf\n")
    _write(
        tmp_path,
        "pkg/helper.py",
        "from . import sibling\nfrom .deep.inner import X\n\ndef helper():\n"
        "    import pkg.lazy\n    return pkg.lazy.VALUE\n",
    )
    _write(tmp_path, "pkg/sibling.py", "from ..outside import nothing  # climbs past the top: ignored\n")
    _write(tmp_path, "pkg/lazy.py", "VALUE = 1\n")
    _write(tmp_path, "pkg/deep/__init__.py", "")
    _write(tmp_path, "pkg/deep/inner.py", "X = 2\n")
    _write(tmp_path, "pkg/sub/__init__.py", "from .. import helper\n")
    _write(tmp_path, "pkg/sub/leaf.py", "LEAF = 3\n")
    _write(tmp_path, "pkg/unused.py", "import pkg.main\n")
    _write(tmp_path, "other/__init__.py", "")
    _write(tmp_path, "other/thing.py", "")
    return tmp_path


def _rel(paths, root):
    return [p.relative_to(root).as_posix() for p in paths]


def test_closure_follows_from_relative_lazy_and_package_imports(toy_tree):
    closure = _rel(import_closure(["pkg.main"], toy_tree), toy_tree)
    assert closure == [
        "pkg/__init__.py",
        "pkg/deep/__init__.py",
        "pkg/deep/inner.py",
        "pkg/helper.py",
        "pkg/lazy.py",
        "pkg/main.py",
        "pkg/sibling.py",
        "pkg/sub/__init__.py",
        "pkg/sub/leaf.py",
    ]


def test_closure_only_follows_the_packages_asked_for(toy_tree):
    _write(toy_tree, "pkg/bridge.py", "import other.thing\n")
    assert "other/thing.py" not in _rel(import_closure(["pkg.bridge"], toy_tree), toy_tree)
    both = _rel(import_closure(["pkg.bridge"], toy_tree, packages=["pkg", "other"]), toy_tree)
    assert {"other/__init__.py", "other/thing.py"} <= set(both)


def test_closure_skips_modules_that_do_not_exist_yet(toy_tree):
    assert import_closure(["pkg.not_written_yet"], toy_tree) == [toy_tree / "pkg/__init__.py"]
    _write(toy_tree, "pkg/uses_future.py", "from pkg import not_written_yet\nfrom pkg.lazy import VALUE\n")
    assert _rel(import_closure(["pkg.uses_future"], toy_tree), toy_tree) == [
        "pkg/__init__.py",
        "pkg/lazy.py",
        "pkg/uses_future.py",
    ]


def test_excluded_module_is_neither_included_nor_followed(toy_tree):
    closure = _rel(import_closure(["pkg.main"], toy_tree, exclude=["pkg.helper"]), toy_tree)
    assert closure == ["pkg/__init__.py", "pkg/main.py", "pkg/sub/__init__.py", "pkg/sub/leaf.py"]


# --------------------------------------------------------------------------- writer


@pytest.fixture
def two_stages(toy_tree, monkeypatch):
    """Stage a runs pkg/a_only.py + pkg/shared.py; stage b runs only pkg/shared.py."""
    _write(toy_tree, "pkg/a_only.py", "from pkg import shared\nA = 1  # first\n")
    _write(toy_tree, "pkg/shared.py", "S = 1\n")
    table = {
        "a": StageSpec("a", "a", ("pkg.a_only",), ("seed",), ()),
        "b": StageSpec("b", "b", ("pkg.shared",), ("seed",), ("a",)),
    }
    monkeypatch.setattr(stages, "STAGES", table)
    return toy_tree


def _age(paths, seconds=1_000):
    """Push mtimes into the past so an untouched file is told apart from a rewritten one."""
    for path in paths:
        stamp = path.stat().st_mtime - seconds
        os.utime(path, (stamp, stamp))
    return {path: path.stat().st_mtime for path in paths}


def test_writer_reruns_exactly_the_stages_a_change_touches(two_stages, tmp_path):
    out = tmp_path / "fingerprints"
    assert write_fingerprints(config_from_dict({}), out, two_stages) == ["a", "b"]
    files = [out / "a.json", out / "b.json"]
    mtimes = _age(files)

    _write(two_stages, "pkg/a_only.py", "from pkg import shared\n\nA = 1  # edited comment\n")
    assert write_fingerprints(config_from_dict({}), out, two_stages) == []
    assert {f: f.stat().st_mtime for f in files} == mtimes

    _write(two_stages, "pkg/a_only.py", "from pkg import shared\nA = 2\n")
    assert write_fingerprints(config_from_dict({}), out, two_stages) == ["a"]
    assert (out / "b.json").stat().st_mtime == mtimes[out / "b.json"]
    assert (out / "a.json").stat().st_mtime != mtimes[out / "a.json"]

    _write(two_stages, "pkg/shared.py", "S = 2\n")
    assert write_fingerprints(config_from_dict({}), out, two_stages) == ["a", "b"]


def test_stage_fingerprint_follows_aged_modules_edited_within_one_process(two_stages):
    """Each module's hash and imports are remembered per process (``memo_by_stat``); an edit of its
    body or of its imports still moves the fingerprint."""
    _write(two_stages, "pkg/extra.py", "E = 1\n")
    _age(list(two_stages.rglob("*.py")))
    first = stage_fingerprint("a", two_stages)
    assert stage_fingerprint("a", two_stages) == first
    _write(two_stages, "pkg/shared.py", "S = 2\n")
    second = stage_fingerprint("a", two_stages)
    assert second["fingerprint"] != first["fingerprint"]
    _write(two_stages, "pkg/a_only.py", "from pkg import shared, extra\nA = 1  # first\n")
    assert "pkg/extra.py" in stage_fingerprint("a", two_stages)["modules"]


def test_written_file_is_deterministic_sorted_json(two_stages, tmp_path):
    out = tmp_path / "fingerprints"
    write_fingerprints(config_from_dict({}), out, two_stages)
    text = (out / "a.json").read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert sorted(data["modules"]) == ["pkg/__init__.py", "pkg/a_only.py", "pkg/shared.py"]
    assert data == stage_fingerprint("a", two_stages)


def test_the_history_copy_is_named_by_the_md5_dvc_lock_records(two_stages, tmp_path):
    """``grpo status`` finds the last run's fingerprint through the md5 dvc.lock holds for it."""
    out = tmp_path / "fingerprints"
    write_fingerprints(config_from_dict({}), out, two_stages)
    text = (out / "a.json").read_text()
    assert history_path(out, text) == out / HISTORY_DIR / f"{hashlib.md5(text.encode()).hexdigest()}.json"
    assert history_path(out, text).read_text() == text


def test_writer_rewrites_a_tampered_file(two_stages, tmp_path):
    out = tmp_path / "fingerprints"
    write_fingerprints(config_from_dict({}), out, two_stages)
    good = (out / "b.json").read_text()
    (out / "b.json").write_text("{}\n")
    assert write_fingerprints(config_from_dict({}), out, two_stages) == ["b"]
    assert (out / "b.json").read_text() == good


def test_cli_run_writes_one_file_per_real_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert fingerprint.run(Config()) == 0
    written = sorted(p.stem for p in (tmp_path / "fingerprints").glob("*.json"))
    assert written == sorted(stages.STAGES)
    assert "fingerprint: sft" in capsys.readouterr().out


def test_a_changed_raw_dataset_file_reruns_prepare_alone(tmp_path, monkeypatch):
    """`grpo fingerprint` (the always-run stage every other depends on through its file) records the
    published dataset files prepare reads: an edited, added or removed raw file changes
    fingerprints/prepare.json and nothing else; with synthetic sources the file has no raw_data key."""
    import shutil

    raw = tmp_path / "bbq"
    shutil.copytree(ROOT / "tests" / "fixtures" / "bbq", raw)
    halueval = tmp_path / "qa_data.json"
    shutil.copy(ROOT / "tests" / "fixtures" / "halueval_qa.json", halueval)
    cfg = config_from_dict(
        {
            "data": {
                "fairness_source": "bbq",
                "fairness_path": str(raw),
                "hallucination_source": "halueval",
                "hallucination_path": str(halueval),
            }
        }
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / fingerprint.FINGERPRINT_DIR

    def prepare_raw() -> dict:
        assert fingerprint.run(cfg) == 0
        return json.loads((out / "prepare.json").read_text())["raw_data"]

    first = prepare_raw()
    assert set(first) == {"data.fairness_path", "data.hallucination_path"}
    assert {Path(f).name for f in first["data.fairness_path"]} == {p.name for p in raw.iterdir()}
    assert list(first["data.hallucination_path"]) == [halueval.as_posix()]
    edits = [
        lambda: (raw / "Age.jsonl").write_text(
            (raw / "Age.jsonl").read_text().replace('"label": 0', '"label": 1', 1)
        ),
        lambda: (raw / "Extra.jsonl").write_text("{}\n"),
        lambda: (raw / "Extra.jsonl").unlink(),
        lambda: halueval.write_text(halueval.read_text() + "\n"),
    ]
    for edit in edits:
        before = {p.name: p.read_text() for p in out.glob("*.json")}
        edit()
        assert prepare_raw() != first
        after = {p.name: p.read_text() for p in out.glob("*.json")}
        assert [name for name in before if before[name] != after[name]] == ["prepare.json"]
        first = prepare_raw()
    assert fingerprint.run(config_from_dict({})) == 0
    assert "raw_data" not in json.loads((out / "prepare.json").read_text())


def test_a_relative_import_in_a_packages_init_is_relative_to_that_package(toy_tree):
    """``from . import x`` in ``pkg/plug/__init__.py`` names ``pkg.plug.x``, not ``pkg.x``."""
    _write(toy_tree, "pkg/plug/__init__.py", "from . import only_here\n")
    _write(toy_tree, "pkg/plug/only_here.py", "Z = 1\n")
    assert _rel(import_closure(["pkg.plug"], toy_tree), toy_tree) == [
        "pkg/__init__.py",
        "pkg/plug/__init__.py",
        "pkg/plug/only_here.py",
    ]


def test_an_excluded_package_keeps_its_submodules_out(toy_tree):
    """Excluding ``grpo.config`` must also keep ``grpo.config.train`` out, imported by its full name."""
    closure = _rel(import_closure(["pkg.main"], toy_tree, exclude=["pkg.sub"]), toy_tree)
    assert not [path for path in closure if path.startswith("pkg/sub/")]
    assert "pkg/helper.py" in closure


def test_a_published_dataset_is_fingerprinted_when_the_other_task_is_synthetic(tmp_path):
    """One task synthetic, the other read from a file: the file still reruns prepare when it changes."""
    import shutil

    from grpo.files import file_sha256

    halueval = tmp_path / "qa_data.json"
    shutil.copy(ROOT / "tests" / "fixtures" / "halueval_qa.json", halueval)
    cfg = config_from_dict(
        {"data": {"hallucination_source": "halueval", "hallucination_path": str(halueval)}}
    )
    assert cfg.data.fairness_source == "synthetic"
    assert fingerprint.raw_data_fingerprint(cfg) == {
        "data.hallucination_path": {halueval.as_posix(): file_sha256(halueval)}
    }


def test_where_a_module_file_and_a_package_share_a_name_the_package_is_the_module(tmp_path):
    """Python imports ``a/b/__init__.py`` over ``a/b.py`` when both exist: the fingerprint reads the same file."""
    import importlib
    import sys

    (tmp_path / "pkgx" / "b").mkdir(parents=True)
    (tmp_path / "pkgx" / "__init__.py").write_text("")
    (tmp_path / "pkgx" / "b.py").write_text("WHICH = 'module'\n")
    (tmp_path / "pkgx" / "b" / "__init__.py").write_text("WHICH = 'package'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        imported = importlib.import_module("pkgx.b")
        assert fingerprint.module_file("pkgx.b", tmp_path) == Path(imported.__file__)
        assert imported.WHICH == "package"
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("pkgx", "pkgx.b"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "names"),
    [
        # a relative import two levels up, from a module and from a package's __init__
        ("from .. import x", "a.b.c", False, {"a", "a.x"}),
        ("from ..d import y", "a.b.c", False, {"a.d", "a.d.y"}),
        ("from .. import x", "a.b", True, {"a", "a.x"}),
        ("from . import x", "a", True, {"a", "a.x"}),
        # one that climbs past the top names nothing, and the imports after it still count
        ("from ... import x\nimport y", "a.b", False, {"y"}),
        ("from .. import x", "a", False, set()),
        ("from .. import x", "a", True, set()),
    ],
)
def test_relative_imports_resolve_as_python_resolves_them(source, module, is_package, names):
    assert fingerprint.imported_names(source, module, is_package) == names


