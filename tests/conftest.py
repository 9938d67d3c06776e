"""Shared fixtures: the embedded tiny model and the real tokenizers of ../shared/tokenizers."""

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
SHARED_TOKENIZERS = ROOT.parent / "shared" / "tokenizers"
REAL_TOKENIZERS = ("llama-3.2-instruct", "qwen2.5-0.5b-instruct", "phi-3-mini-4k-instruct")

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


def shared_tokenizer_path(name: str) -> Path:
    path = SHARED_TOKENIZERS / name
    if not path.is_dir():
        pytest.skip(f"{path} is absent (../shared/tokenizers not beside the project)")
    return path


@pytest.fixture(params=REAL_TOKENIZERS)
def real_tokenizer(request):
    """Each real chat tokenizer, loaded through grpo.model.loading.load_tokenizer (skips when absent)."""
    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    return load_tokenizer(shared_tokenizer_path(request.param), ModelConfig())


@pytest.fixture(params=("tiny",) + REAL_TOKENIZERS)
def any_tokenizer(request, tiny_tokenizer):
    """The tiny tokenizer and each real one."""
    if request.param == "tiny":
        return tiny_tokenizer
    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    return load_tokenizer(shared_tokenizer_path(request.param), ModelConfig())


@pytest.fixture(scope="session")
def built_project(tmp_path_factory):
    """The project with tiny params in a throwaway git repo after one full `dvc repro`; clone, don't edit."""
    from tests.project_copy import build_project

    return build_project(tmp_path_factory.mktemp("built") / "project")
