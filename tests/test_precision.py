"""grpo/model/precision.py: bf16 autocast over fp32 master weights, SDPA, gradient checkpointing (on CPU), the
frozen weights' casts (the head: tests/test_precision_head.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.config import LoraConfig, ModelConfig, config_from_dict, load_config
from grpo.core.batching import sft_batch
from grpo.core.logprobs import score_completions
from grpo.data.prompts import example_messages, sft_target
from grpo.model.chat import render_sft
from grpo.model.loading import load_model, save_model
from grpo.model.lora import wrap_lora
from grpo.model.precision import (
    apply_memory_settings,
    autocast_enabled,
    bf16_autocast,
    cast_frozen_weights_once,
    cpu_has_native_bf16,
    describe,
    fp32_head,
    frozen_linears_in_bf16,
)
from grpo.train.causal_lm import sft_loss

RECORDS = [
    {"task": "hallucination", "context": "Elbrook was founded in 1821 by Mara Venn.", "question": "Who founded it?",
     "answer": "Mara Venn", "answerable": True},
    {"task": "hallucination", "context": "The river town is known for glass.", "question": "When was it founded?",
     "answer": None, "answerable": False},
]
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def _batch(tokenizer):
    examples = [render_sft(tokenizer, example_messages(r), sft_target(r)) for r in RECORDS]
    return sft_batch(examples, tokenizer.pad_token_id)


def _compute_dtypes(model, ids) -> tuple[torch.dtype, torch.dtype]:
    """(dtype of a projection inside the body, dtype of the logits) of one forward."""
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        logits = model(input_ids=ids).logits
    finally:
        hook.remove()
    return seen[0], logits.dtype


def test_autocast_on_cpu_exactly_where_the_cpu_has_native_bf16(tiny_model, tiny_tokenizer, monkeypatch):
    """The body's matmuls run in bf16 where it is native; the head's logits are fp32 in every case."""
    ids = _batch(tiny_tokenizer).input_ids
    native = cpu_has_native_bf16()
    with bf16_autocast(CPU, bf16=True):  # bf16 where it is native (~4x a fp32 matmul), fp32 where emulated
        assert _compute_dtypes(tiny_model, ids) == (torch.bfloat16 if native else torch.float32, torch.float32)
    assert autocast_enabled(CPU, bf16=True) == native and not autocast_enabled(CPU, bf16=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not autocast_enabled(CPU, bf16=True)  # an older CPU: bf16 is emulated, slower; fp32 it is
    assert autocast_enabled(torch.device("cuda"), bf16=True)  # a GPU's bf16 does not depend on its host's CPU
    with bf16_autocast(CPU, bf16=True):
        assert _compute_dtypes(tiny_model, ids) == (torch.float32, torch.float32)
    with bf16_autocast(CPU, bf16=True, force=True):
        assert _compute_dtypes(tiny_model, ids) == (torch.bfloat16, torch.float32)
    with bf16_autocast(CPU, bf16=False, force=False):
        assert _compute_dtypes(tiny_model, ids) == (torch.float32, torch.float32)


def test_bf16_step_keeps_fp32_master_weights_and_optimizer_state(tiny_model, tiny_tokenizer):
    """The stated choice: bf16 compute, fp32 weights, gradients and Adam moments; the loss is close."""
    batch = _batch(tiny_tokenizer)
    tiny_model.train()
    full, _ = sft_loss(tiny_model, batch)
    with bf16_autocast(CPU, bf16=True, force=True):
        loss, _ = sft_loss(tiny_model, batch)
    assert loss.dtype == torch.float32 and abs(loss.item() - full.item()) < 5e-2 * full.item()
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    loss.backward()
    optimizer.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in tiny_model.parameters())
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    assert any(not torch.equal(a, p) for a, p in zip(before, tiny_model.parameters(), strict=True))


def _scored(model, tokenizer):
    batch = _batch(tokenizer)
    return score_completions(model, batch.input_ids, batch.attention_mask, 8, temperature=1.0).logprobs


def test_sdpa_is_loaded_and_scores_like_eager(tiny_model, tiny_tokenizer, tmp_path):
    save_model(tiny_model, tiny_tokenizer, tmp_path)
    sdpa = load_model(tmp_path, ModelConfig()).eval()
    eager = load_model(tmp_path, ModelConfig(attn_implementation="eager")).eval()
    # model.attn_implementation: sdpa loads sdpa_grouped (grpo/model/kernels.py: sdpa without the K/V copy)
    assert sdpa.config._attn_implementation == "sdpa_grouped" and eager.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(_scored(sdpa, tiny_tokenizer), _scored(eager, tiny_tokenizer),
                                   atol=1e-5, rtol=1e-5)
    assert "attention sdpa_grouped" in describe(sdpa, CPU, bf16=False) and "compute float32" in describe(sdpa, CPU, False)
    assert ("compute bf16 autocast" in describe(sdpa, CPU, True)) == cpu_has_native_bf16()


def _lora_grads(model, tokenizer) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    policy = wrap_lora(model, LoraConfig(r=4))
    for name, param in policy.named_parameters():  # lora_B starts at 0: give it a value so A gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(1))
    policy.train()
    loss, _ = sft_loss(policy, _batch(tokenizer))
    loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}


def test_gradient_checkpointing_gives_the_same_lora_gradients(tiny_tokenizer, tiny_sizes):
    """Non-reentrant checkpointing reaches a LoRA adapter on frozen weights, with identical gradients."""
    from grpo.model.tiny import build_tiny_model

    plain = _lora_grads(build_tiny_model(tiny_tokenizer, tiny_sizes, seed=0), tiny_tokenizer)
    model = apply_memory_settings(build_tiny_model(tiny_tokenizer, tiny_sizes, seed=0),
                                  ModelConfig(gradient_checkpointing=True))
    assert model.is_gradient_checkpointing
    checkpointed = _lora_grads(model, tiny_tokenizer)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)


def test_precision_fields_are_config_with_defaults():
    cfg = config_from_dict({})
    assert cfg.model.attn_implementation == "sdpa" and not cfg.model.gradient_checkpointing
    assert not cfg.sft.bf16 and not cfg.grpo.bf16  # fp32 unless asked: the exactness tests rely on it
    shipped = load_config(ROOT / "params.yaml")
    # the 1.0M embedded model gains nothing from bf16 on CPU (docs/configuration.md, precision): the shipped params run fp32
    assert not (shipped.pretrain.bf16 or shipped.sft.bf16 or shipped.grpo.bf16)
    assert config_from_dict({"model": {"gradient_checkpointing": True}}).model.gradient_checkpointing


def _casts(fn) -> int:
    """How many dtype casts (``aten::_to_copy``) ``fn`` runs."""
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_frozen_weights_are_cast_once_per_block_with_the_same_numbers(tiny_model, tiny_tokenizer):
    """Autocast re-casts frozen (requires_grad False) weights at every forward; inside
    ``cast_frozen_weights_once`` each is cast once, the outputs are bit-equal and the flags come back."""
    policy = wrap_lora(tiny_model, LoraConfig(r=4))
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    ids = _batch(tiny_tokenizer).input_ids[:1, :8]

    def forwards(out):
        for _ in range(5):
            out.append(policy(input_ids=ids).logits)

    plain, once = [], []
    with torch.no_grad(), bf16_autocast(CPU, bf16=True, force=True):
        plain_casts = _casts(lambda: forwards(plain))
    with torch.no_grad(), bf16_autocast(CPU, bf16=True, force=True), cast_frozen_weights_once(policy):
        once_casts = _casts(lambda: forwards(once))
    assert all(torch.equal(a, b) for a, b in zip(plain, once, strict=True))
    n_linear = sum(1 for n in frozen if n.endswith(".weight") and "embed" not in n and "norm" not in n)
    assert plain_casts - once_casts >= 4 * n_linear  # 4 of the 5 forwards no longer cast the frozen weights
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == frozen
    with pytest.raises(RuntimeError), cast_frozen_weights_once(policy):
        raise RuntimeError("a failing block")
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == frozen
    with cast_frozen_weights_once(policy):  # outside autocast: nothing to cache, nothing touched
        assert {n for n, p in policy.named_parameters() if not p.requires_grad} == frozen


def test_frozen_linears_held_in_bf16_give_the_same_logits_and_gradients_with_fewer_casts(tiny_model, tiny_tokenizer):
    """Inside ``frozen_linears_in_bf16`` the frozen linear weights are bf16: a forward and backward under
    bf16 autocast give bit-equal logits and LoRA gradients with fewer casts; the head, norms, embeddings
    and LoRA weights stay fp32, and every fp32 tensor is back after the block (also when it fails)."""
    policy = wrap_lora(fp32_head(tiny_model), LoraConfig(r=4))
    batch = _batch(tiny_tokenizer)
    before = {n: (p.data_ptr(), p.dtype) for n, p in policy.named_parameters()}

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy.zero_grad()
        with bf16_autocast(CPU, bf16=True, force=True):
            logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits, {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}

    plain_casts = _casts(run)
    plain_logits, plain_grads = run()
    with frozen_linears_in_bf16([policy], on=True):
        dtypes = {n: p.dtype for n, p in policy.named_parameters()}
        held_casts = _casts(run)
        held_logits, held_grads = run()
    assert torch.equal(plain_logits, held_logits)
    assert plain_grads.keys() == held_grads.keys() and all(torch.equal(plain_grads[n], held_grads[n]) for n in plain_grads)
    bf16 = {n for n, d in dtypes.items() if d == torch.bfloat16}
    assert bf16 and all(".self_attn." in n or ".mlp." in n for n in bf16)
    assert not any("lora_" in n or "norm" in n or "embed" in n or "lm_head" in n for n in bf16)
    assert held_casts < plain_casts - len(bf16) // 2
    assert all((p.data_ptr(), p.dtype) == before[n] for n, p in policy.named_parameters())
    with pytest.raises(RuntimeError), frozen_linears_in_bf16([policy], on=True):
        raise RuntimeError("a failing block")
    assert all((p.data_ptr(), p.dtype) == before[n] for n, p in policy.named_parameters())
    with frozen_linears_in_bf16([policy], on=False):
        assert all(p.dtype == torch.float32 for p in policy.parameters())


@pytest.mark.parametrize("avx512_bf16, amx", [(True, False), (False, True)])
def test_either_bf16_instruction_set_makes_the_cpus_bf16_native(monkeypatch, avx512_bf16, amx):
    """AVX512-BF16 alone (Cooper Lake, Zen 4) or AMX alone is native bf16: autocast runs there."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_has_native_bf16() and autocast_enabled(CPU, bf16=True)


