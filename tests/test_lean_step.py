"""grpo/model/fast/lean_step.py: the lean decode step computes the model's own numbers, and ``decode`` uses it
only where it was seen to."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.config import SamplingConfig
from grpo.core.attention import model_attention_mask
from grpo.core.batching import left_pad, position_ids_from_mask
from grpo.model import chat
from grpo.model.architectures import preset_config
from grpo.model.fast import FastPathWarning, lean_step
from grpo.model.fast.decode import reserve_room
from grpo.model.fast.lean_step import LeanStep
from grpo.model.kernels import GROUPED_SDPA
from grpo.model.lora import adapter_disabled
from grpo.model.precision import bf16_autocast, fp32_head, frozen_linears_in_bf16
from tests.test_attention import QWEN_SHRUNK
from tests.test_decode import _decode, _generate, _prompts, varied_policy
from tests.weights import fill_adapter, spread_weights

ADAPTERS = {
    "none": None,
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "some": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],  # k and o without an adapter
    "off": ["q_proj", "k_proj", "v_proj", "o_proj"],  # turned off (``adapter_disabled``: the reference)
}
PRECISIONS = ("fp32", "bf16", "bf16-frozen")  # bf16-frozen: the GRPO step's frozen weights held in bf16


@pytest.fixture
def verdicts(monkeypatch) -> dict:
    """The verdicts of this test alone."""
    monkeypatch.setattr(lean_step, "_VERDICTS", {})
    return lean_step._VERDICTS


def _model(tiny_model, name: str, adapter: str) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = tiny_model if name == "tiny-llama" else fp32_head(
        AutoModelForCausalLM.from_config(preset_config("qwen2.5-0.5b", QWEN_SHRUNK)).float()
    )
    model.config._attn_implementation = GROUPED_SDPA
    spread_weights(model, gen)
    if ADAPTERS[adapter] is not None:
        model = fill_adapter(get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=ADAPTERS[adapter])), gen)
    return model.eval()


def _precision(model, precision: str):
    frozen = frozen_linears_in_bf16([model], precision == "bf16-frozen")
    autocast = bf16_autocast(torch.device("cpu"), precision != "fp32", force=True)
    return frozen, autocast


def _step(model, ids, mask):
    """The keyword arguments of a decode step over ``ids`` [N, Q] whose mask covers every column so far."""
    positions = position_ids_from_mask(mask)[:, -ids.shape[1]:]
    return {"input_ids": ids, "attention_mask": model_attention_mask(model, mask, ids.shape[1]), "position_ids": positions}


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["tiny-llama", "qwen2.5-shrunk"])
def test_lean_step_gives_the_models_logits_and_cache(tiny_model, name, precision, adapter):
    """Three decode steps after a prefill, the model's forward on one copy of the cache and the lean step
    on another: the same logits and the same keys and values, bit for bit (Qwen2.5's q/k/v carry biases)."""
    model = _model(tiny_model, name, adapter)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batch = left_pad([torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (9, 3, 14, 6, 11)], 0)
    frozen, autocast = _precision(model, precision)
    off = adapter_disabled(model) if adapter == "off" else contextlib.nullcontext()
    with torch.no_grad(), frozen, autocast, off:
        mask = batch.attention_mask
        out = model(**_step(model, batch.input_ids, mask), use_cache=True, logits_to_keep=1)
        reserve_room(out.past_key_values, 8)
        own_cache, lean_cache = out.past_key_values, copy.deepcopy(out.past_key_values)
        step = LeanStep.build(model)
        assert step is not None, "the model is one the lean step computes"
        ids = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            kwargs = _step(model, ids, mask)
            own = model(**kwargs, past_key_values=own_cache, use_cache=True, logits_to_keep=1).logits
            got = step(kwargs["input_ids"], kwargs["attention_mask"], kwargs["position_ids"], lean_cache)
            assert got.shape == own.shape == (len(ids), 1, vocab)
            assert got.dtype == own.dtype == torch.float32
            assert torch.equal(got, own)
            for mine, theirs in zip(lean_cache.layers, own_cache.layers, strict=True):
                assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
            ids = own[:, -1:].argmax(-1)


@pytest.fixture
def policy(tiny_model, tiny_tokenizer):
    return varied_policy(tiny_model, tiny_tokenizer)


@pytest.fixture
def calls(monkeypatch):
    """The logits of every lean step run."""
    seen = []
    call = LeanStep.__call__

    def counted(self, *args):
        logits = call(self, *args)
        seen.append(logits)
        return logits

    monkeypatch.setattr(LeanStep, "__call__", counted)
    return seen


SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_decode_takes_lean_steps_and_samples_generates_tokens(policy, tiny_tokenizer, precision, calls, verdicts):
    """Past the first step (the model's) every step is lean, the first lean one checked against the model's
    forward; the tokens are ``generate``'s."""
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    frozen, autocast = _precision(policy, precision)
    with frozen, autocast:
        for seed in (0, 1):
            expected = _generate(policy, tiny_tokenizer, batch, SAMPLING, eos, False, seed)
            before = len(calls)
            got = _decode(policy, tiny_tokenizer, batch, SAMPLING, eos, False, seed, prefilled=True)
            assert torch.equal(got, expected)
            steps = got.shape[1] - batch.input_ids.shape[1]
            assert len(calls) - before == steps - 1, "every step after the first ran lean"
    assert list(verdicts.values()) == [True]
    assert [key[-1] for key in verdicts] == [batch.input_ids.shape[0]], "a verdict is kept per row count"


def _moved_logits(monkeypatch):
    """A lean step whose logits move by one part in a thousand: a wrong scaling, a wrong kernel."""
    call = LeanStep.__call__
    monkeypatch.setattr(LeanStep, "__call__", lambda self, *args: call(self, *args) * 1.001)


def _moved_cache(monkeypatch):
    """A lean step whose logits are right but which leaves a wrong value in layer 0's cache."""
    call = LeanStep.__call__

    def wrong(self, ids, mask, positions, cache):
        logits = call(self, ids, mask, positions, cache)
        cache.layers[0].values[..., -1, 0] += 1.0
        return logits

    monkeypatch.setattr(LeanStep, "__call__", wrong)


@pytest.mark.parametrize("fault", [_moved_logits, _moved_cache], ids=["logits", "cache"])
def test_a_lean_step_that_moves_a_number_is_never_used(policy, tiny_tokenizer, fault, monkeypatch, verdicts):
    """The check sees the difference, the kind is recorded as not lean, with a warning that names it; the
    cache keeps the model's keys and values, and the tokens stay ``generate``'s."""
    fault(monkeypatch)
    runs = []
    call = LeanStep.__call__
    monkeypatch.setattr(LeanStep, "__call__", lambda self, *args: runs.append(1) or call(self, *args))
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    for seed in (0, 1):
        expected = _generate(policy, tiny_tokenizer, batch, SAMPLING, eos, False, seed)
        with pytest.warns(FastPathWarning, match="lean decode step' fell back to the model's own forward") \
                if seed == 0 else contextlib.nullcontext():
            got = _decode(policy, tiny_tokenizer, batch, SAMPLING, eos, False, seed, prefilled=False)
        assert torch.equal(got, expected)
    assert len(runs) == 1, "the lean step ran once, inside the check"
    assert list(verdicts.values()) == [False]


def test_build_declines_what_it_cannot_compute(tiny_model):
    """The model's own forward runs for a training-mode model, one with a forward hook, a DoRA adapter and
    another architecture."""
    model = _model(copy.deepcopy(tiny_model), "tiny-llama", "attention")
    assert LeanStep.build(model) is not None
    assert LeanStep.build(model.train()) is None
    model.eval()
    handle = model.get_base_model().model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert LeanStep.build(model) is None
    handle.remove()
    assert LeanStep.build(model) is not None
    dora = get_peft_model(
        _model(copy.deepcopy(tiny_model), "tiny-llama", "none"),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    ).eval()
    assert LeanStep.build(dora) is None
    qwen3 = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", head_dim=16, **QWEN_SHRUNK)).eval()
    assert LeanStep.build(qwen3) is None, "Qwen3's layers normalise q and k: not Llama's layer"


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_build_declines_an_active_dropout_a_lora_bias_and_a_weight_off_the_cpu(tiny_model):
    """What the step would compute otherwise than the model: an adapter's dropout left in train mode (it
    drops inputs; at p 0 it drops none), a LoRA factor with a bias (the step adds none), and a weight that
    is not on the CPU (an offloaded or sharded weight)."""
    model = get_peft_model(
        _model(copy.deepcopy(tiny_model), "tiny-llama", "none"),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1),
    ).eval()
    assert LeanStep.build(model) is not None, "an adapter's dropout in eval mode drops nothing"
    dropout = model.get_base_model().model.layers[1].self_attn.v_proj.lora_dropout["default"]
    dropout.train()
    assert LeanStep.build(model) is None
    dropout.p = 0.0
    assert LeanStep.build(model) is not None, "a dropout of p 0 drops nothing, even in train mode"
    biased = get_peft_model(
        _model(copy.deepcopy(tiny_model), "tiny-llama", "none"),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_bias=True),
    ).eval()
    assert LeanStep.build(biased) is None
    off = _model(copy.deepcopy(tiny_model), "tiny-llama", "attention")
    off.get_base_model().model.layers[1].mlp.down_proj.to("meta")
    assert LeanStep.build(off) is None


def test_build_declines_a_model_with_a_forward_pre_hook(tiny_model):
    """A pre-hook (FSDP's gather, a profiler's) runs before a module's forward: the lean step would skip it,
    whether it sits on one module or on every module."""
    model = _model(copy.deepcopy(tiny_model), "tiny-llama", "attention")
    handle = model.get_base_model().model.layers[0].self_attn.register_forward_pre_hook(lambda *args: None)
    assert LeanStep.build(model) is None
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert LeanStep.build(model) is None
    finally:
        handle.remove()
    assert LeanStep.build(model) is not None


def test_build_declines_a_qwen2_model_with_its_sliding_window_on():
    """Qwen2 with ``use_sliding_window`` attends within a window: not the full attention the step computes."""
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=4, **QWEN_SHRUNK)
    assert config.sliding_window == 4
    assert LeanStep.build(AutoModelForCausalLM.from_config(config).eval()) is None
    config = AutoConfig.for_model("qwen2", use_sliding_window=False, **QWEN_SHRUNK)
    assert LeanStep.build(AutoModelForCausalLM.from_config(config).eval()) is not None


def test_lean_step_of_a_merged_adapter_gives_the_models_logits(tiny_model):
    """A merged LoRA adapter lives in the base weights (PEFT's forward is the base layer's alone): the step
    adds no adapter product on top, so its logits and cache are the model's, bit for bit."""
    model = _model(tiny_model, "tiny-llama", "attention")
    model.merge_adapter()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batch = left_pad([torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (9, 3, 14)], 0)
    with torch.no_grad():
        out = model(**_step(model, batch.input_ids, batch.attention_mask), use_cache=True, logits_to_keep=1)
        reserve_room(out.past_key_values, 4)
        own_cache, lean_cache = out.past_key_values, copy.deepcopy(out.past_key_values)
        step = LeanStep.build(model)
        assert step is not None
        mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones(3, 1)], dim=1)
        kwargs = _step(model, out.logits[:, -1:].argmax(-1), mask)
        own = model(**kwargs, past_key_values=own_cache, use_cache=True, logits_to_keep=1).logits
        got = step(kwargs["input_ids"], kwargs["attention_mask"], kwargs["position_ids"], lean_cache)
    assert torch.equal(got, own)
    for mine, theirs in zip(lean_cache.layers, own_cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_kind_checked_without_autocast_is_checked_again_under_it(policy, tiny_tokenizer, monkeypatch, verdicts):
    """Autocast is part of a step's kind: a lean step that moves its logits only under bf16 autocast is
    checked there too (not trusted on the fp32 verdict), refused with a warning, and the tokens stay
    ``generate``'s."""
    call = LeanStep.__call__
    monkeypatch.setattr(LeanStep, "__call__", lambda self, *args: call(self, *args) * (
        1.001 if torch.is_autocast_enabled("cpu") else 1.0))
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    _decode(policy, tiny_tokenizer, batch, SAMPLING, eos, False, 0, prefilled=False)
    assert list(verdicts.values()) == [True]
    with bf16_autocast(torch.device("cpu"), True, force=True):
        expected = _generate(policy, tiny_tokenizer, batch, SAMPLING, eos, False, 0)
        with pytest.warns(FastPathWarning, match="lean decode step' fell back"):
            got = _decode(policy, tiny_tokenizer, batch, SAMPLING, eos, False, 0, prefilled=False)
    assert torch.equal(got, expected)
    assert list(verdicts.values()) == [True, False]
