"""Shared fixtures: the embedded tiny model, the real tokenizers, and the developers' ``shared/`` folder.

The repository ships the real tokenizers whose licences allow it (``tests/fixtures/tokenizers/``). What
it may not ship (the Llama-3.2 tokenizer) is read from a ``shared/`` folder beside the project, or
where ``GRPO_SHARED_DIR`` points. Tests that read it carry the ``needs_shared`` marker and skip, naming
the folder, where it is absent: a fresh clone runs everything else, and CI runs ``pytest -m
needs_shared`` with ``GRPO_SHARED_DIR`` set (``.ci/run``), where an absent file fails instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"
SHARED_DIR = Path(os.environ.get("GRPO_SHARED_DIR") or ROOT.parent / "shared")
REAL_TOKENIZERS = ("llama-3.2-instruct", "qwen2.5-0.5b-instruct", "phi-3-mini-4k-instruct")


class SharedAbsent(pytest.skip.Exception):
    """The skip of a test whose file in the shared folder is absent (see ``pytest_runtest_makereport``)."""


def shared_path(relative: str) -> Path:
    """``<shared folder>/relative``. Absent: the test skips, or fails where ``GRPO_SHARED_DIR`` names the folder."""
    path = SHARED_DIR / relative
    if path.exists():
        return path
    if os.environ.get("GRPO_SHARED_DIR"):
        pytest.fail(f"{path} does not exist: GRPO_SHARED_DIR={os.environ['GRPO_SHARED_DIR']} must hold {relative}")
    raise SharedAbsent(f"{path} is absent (no shared/ folder beside the project; GRPO_SHARED_DIR names one)")


def real_tokenizer_path(name: str) -> Path:
    """The folder of real tokenizer ``name``: the repository's fixture, else the shared folder's."""
    fixture = FIXTURE_TOKENIZERS / name
    return fixture if fixture.is_dir() else shared_path(f"tokenizers/{name}")


def tokenizer_param(name: str):
    """``name`` as a pytest parameter, marked ``needs_shared`` where the repository does not ship it."""
    marks = () if (FIXTURE_TOKENIZERS / name).is_dir() else pytest.mark.needs_shared
    return pytest.param(name, marks=marks, id=name)


REAL_TOKENIZER_PARAMS = tuple(tokenizer_param(name) for name in REAL_TOKENIZERS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skipped for an absent shared file without the ``needs_shared`` marker fails: unmarked,
    ``pytest -m needs_shared`` would not select it, and no CI run would ever run it."""
    report = yield
    if (report.skipped and call.excinfo is not None and call.excinfo.errisinstance(SharedAbsent)
            and item.get_closest_marker("needs_shared") is None):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} reads the shared folder ({call.excinfo.value.msg}) but is not marked "
                           "needs_shared: add @pytest.mark.needs_shared (or use tokenizer_param) so CI runs it")
    return report


TINY_TEXTS = (
    "Context: Two friends, a tall one and a short one, met at the station.",
    "Question: Who was late? Options: A. the tall one B. the short one C. Unknown",
    "The river town of Elbrook was founded by Mara Venn in 1821 and is known for glass.",
    "Answer: A. Answer: B. Answer: C. I don't know. The context does not say.",
)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The embedded tokenizer: Llama-3 specials and template, pad == <|eot_id|>, left padding."""
    from grpo.model.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(TINY_TEXTS * 4, vocab_size=400)


@pytest.fixture(scope="session")
def tiny_sizes():
    from grpo.config import TinyModelConfig

    return TinyModelConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )


@pytest.fixture
def tiny_model(tiny_tokenizer, tiny_sizes):
    """A fresh tiny Llama (function scope: tests may train it), fp32, eval mode."""
    from grpo.model.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer, tiny_sizes, seed=0).eval()


@pytest.fixture(params=REAL_TOKENIZER_PARAMS)
def real_tokenizer(request):
    """Each real chat tokenizer, loaded through grpo.model.loading.load_tokenizer (skips when absent)."""
    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    return load_tokenizer(real_tokenizer_path(request.param), ModelConfig())


@pytest.fixture(params=("tiny",) + REAL_TOKENIZER_PARAMS)
def any_tokenizer(request, tiny_tokenizer):
    """The tiny tokenizer and each real one."""
    if request.param == "tiny":
        return tiny_tokenizer
    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    return load_tokenizer(real_tokenizer_path(request.param), ModelConfig())


@pytest.fixture(scope="session")
def built_project(tmp_path_factory):
    """The project with tiny params in a throwaway git repo after one full `dvc repro`; clone, don't edit."""
    from tests.project_copy import build_project

    return build_project(tmp_path_factory.mktemp("built") / "project")
