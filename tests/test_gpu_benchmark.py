"""benchmarks/gpu.py: the CPU smoke run measures every figure; the full run refuses without CUDA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_step import training_flops
from tests.conftest import real_tokenizer_path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_measures_rollouts_the_step_and_memory(tmp_path, capsys):
    tokenizers = real_tokenizer_path("qwen2.5-0.5b-instruct").parent
    out = tmp_path / "new"  # a folder the benchmark makes
    argv = ["--smoke", "--profile", "--out", str(out / "bench.json"), "--peak-tflops", "1.0",
            "--tokenizers-dir", str(tokenizers)]
    assert _bench().main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    (result,) = report["results"]
    assert report["smoke"] and result["architecture"] == "qwen2.5-0.5b"
    rollouts = result["rollouts"]
    assert rollouts["rows"] == 2 * 2 and rollouts["tokens"] == 2 * 2 * 4  # min = max tokens
    for name in ("generate, frozen weights bf16", "decode loop, CUDA graph"):
        assert rollouts[name]["tokens_per_s"] > 0, name
    assert rollouts["decode loop, CUDA graph"]["graph"]["built"] == 0, "no CUDA graph on a CPU"
    step = result["step"]
    assert "error" not in step, step
    assert step["rows"] == 4 and step["completion_width"] == 4 and step["train_s"] > 0 and step["flops"] > 0
    assert step["mfu"] == pytest.approx(step["tflops_per_s"] / 1.0) and step["train_peak_gib"] > 0
    runs = step["steps"]
    assert [r["seen_shapes"] for r in runs] == [False, False, False, True], "warm-up, 2 timed, 1 seen again"
    assert runs[3]["prompt_width"] == runs[1]["prompt_width"], "the seen step reruns the first timed prompts"
    assert runs[1]["prompt_width"] != runs[2]["prompt_width"] or runs[1]["flops"] == runs[2]["flops"]
    assert all(r["tflops_per_s"] == pytest.approx(r["flops"] / r["train_s"] / 1e12) for r in runs)
    assert step["train_s"] in (runs[1]["train_s"], runs[2]["train_s"]), "the median of the new-shape steps"
    assert step["seen_shapes"]["train_s"] == runs[3]["train_s"]
    assert step["seen_shapes"]["mfu"] == pytest.approx(runs[3]["tflops_per_s"])
    assert report["attention"] == "cuDNN left out"
    assert {t["figure"] for t in report["targets"]} >= {"mfu", "train_peak_gib", "graph_vs_generate"}
    assert "| qwen2.5-0.5b |" in capsys.readouterr().out and (out / "bench.md").is_file()
    for phase, operation in (("decode", "aten::argmax"), ("training", "HeadScores")):
        table = (out / f"bench.qwen2.5-0.5b.{phase}-profile.txt").read_text()
        assert operation in table, f"the {phase} profile holds that phase's work"


def test_training_flops_count_each_pass_once_and_the_prompts_once_per_group(tiny_model):
    """A LoRA step with a reference pass: scoring 2N per token through the body (prompts once per group when
    shared), the head on the scored positions, causal attention; the update's backward repeats the forward
    for the inputs' gradients (attention twice) and adds the adapter's weight gradients."""
    cfg = tiny_model.config
    n, v, h, layers = 1000, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    rows, distinct, prompt, completion, lora = 4, 2, 5, 3, 10
    tokens = distinct * prompt + rows * completion
    keys = distinct * prompt * (prompt + 1) / 2 + rows * (completion * prompt + completion * (completion + 1) / 2)
    attention = 4 * layers * h * keys
    head = 2 * v * h * rows * completion
    scoring = 2 * n * tokens + attention + head
    forward = 2 * (n + lora) * tokens + head + attention
    backward = 2 * (n + lora) * tokens + 2 * attention + head + 2 * lora * tokens
    got = training_flops(cfg, rows=rows, distinct=distinct, prompt=prompt, completion=completion,
                                  shared=True, reused_prefill=False, body=n, lora=lora,
                                  passes={"scoring": 1, "policy": 1}, full=False)
    assert got == pytest.approx(scoring + forward + backward)
    unshared = training_flops(cfg, rows=rows, distinct=distinct, prompt=prompt, completion=completion,
                                       shared=False, reused_prefill=False, body=n, lora=lora,
                                       passes={"scoring": 1, "policy": 1}, full=False)
    assert unshared > got, "each row's prompt runs again without the shared prefix"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_full_run_without_cuda_exits_with_a_clear_message(capsys):
    assert _bench().main([]) == 2
    assert "no CUDA device found" in capsys.readouterr().err
