"""README.md and docs/orchestration.md show commands that exist and say what the code does (fast)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from grpo.cli import COMMANDS
from tests.prefect_runs import ARTIFACT_KEYS
from tests.project_copy import ROOT

DOCS = ("README.md", "docs/orchestration.md")


def _code(name: str) -> str:
    """Every fenced code block of one doc, joined."""
    return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", (ROOT / name).read_text(encoding="utf-8"), re.S))


@pytest.mark.parametrize("doc", DOCS)
def test_commands_in_the_docs_exist(doc):
    code = _code(doc)
    for command in re.findall(r"^\s*(?:\$ )?grpo ([a-z-]+)", code, re.M):
        assert command in COMMANDS, f"{doc}: `grpo {command}` is not a command of grpo/cli.py"
    for module in re.findall(r"python -m ([\w.]+)", code):
        assert importlib.util.find_spec(module) is not None, f"{doc}: `python -m {module}`: no such module"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    inline = " ".join(re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text(encoding="utf-8")))
    for target in re.findall(r"(?:^|\s)make ([a-z][a-z0-9-]*)", code + "\n" + inline):
        assert target in targets, f"{doc}: `make {target}` is not a Makefile target"
    assert not re.search(r"deployment run full-retrain(?!/)", code), f"{doc}: Prefect needs flow/deployment"


def test_docs_agree_with_the_code_on_fingerprints_and_wandb():
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    text = "\n".join((ROOT / doc).read_text(encoding="utf-8") for doc in DOCS)
    assert "/fingerprints/" in ignored and "git diff fingerprints" not in text  # nothing there for git to diff
    assert "grpo status" in text
    assert "runs/<experiment>/wandb" in text
    assert "<project>/wandb" not in (ROOT / "tasks" / "dvc_stage.py").read_text(encoding="utf-8")
    metrics = (ROOT / "grpo" / "health" / "metrics.py").read_text(encoding="utf-8")
    assert "dir=str(self.run_dir)" in metrics  # where wandb.init puts runs/<experiment>/wandb


def test_every_artifact_the_tasks_publish_is_documented():
    doc = (ROOT / "docs" / "orchestration.md").read_text(encoding="utf-8")
    published = set(re.findall(r'"([a-z]+(?:-[a-z]+)+)"', "\n".join(
        p.read_text(encoding="utf-8") for p in (ROOT / "tasks").glob("*.py"))))
    keys = {k for k in published if k in ARTIFACT_KEYS or k == "full-retrain-failure"}
    assert ARTIFACT_KEYS | {"full-retrain-failure"} == keys
    for key in keys:
        assert f"`{key}`" in doc, f"docs/orchestration.md does not name the artifact {key!r}"
