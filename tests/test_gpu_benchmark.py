"""benchmarks/gpu.py: the CPU smoke run measures every figure; the full run refuses without CUDA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import real_tokenizer_path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_measures_generation_training_and_memory(tmp_path, capsys):
    tokenizers = real_tokenizer_path("qwen2.5-0.5b-instruct").parent
    out = tmp_path / "bench.json"
    assert _bench().main(["--smoke", "--out", str(out), "--peak-tflops", "1.0", "--tokenizers-dir", str(tokenizers)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert report["smoke"] and result["architecture"] == "qwen2.5-0.5b"
    (hf,) = result["generation"]
    assert hf["engine"] == "hf" and hf["tokens"] == 2 * 2 * 4 and hf["tokens_per_s"] > 0  # min = max tokens
    train = result["training"]
    assert train["sequences"] == 4 and train["step_s"] > 0 and train["flops_per_step"] > 0
    assert train["mfu"] == pytest.approx(train["tflops_per_s"] / 1.0) and train["peak_memory_gib"] > 0
    assert "| qwen2.5-0.5b |" in capsys.readouterr().out


def test_training_flops_follow_the_6n_rule(tiny_model):
    """6 x body parameters per token, 6 x vocab x hidden per scored position, 12 L H S per token."""
    cfg = tiny_model.config
    body = sum(p.numel() for p in tiny_model.parameters()) - cfg.vocab_size * cfg.hidden_size  # tied head
    want = 6 * body * 3 * 10 + 6 * cfg.vocab_size * cfg.hidden_size * 3 * 4 \
        + 12 * cfg.num_hidden_layers * cfg.hidden_size * 10 * 3 * 10
    assert _bench().training_flops(tiny_model, n_sequences=3, seq_len=10, scored=4) == pytest.approx(want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_full_run_without_cuda_exits_with_a_clear_message(capsys):
    assert _bench().main([]) == 2
    assert "no CUDA device found" in capsys.readouterr().err
