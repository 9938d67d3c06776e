"""The gate's view of a step around a small random model, for the tests of the checks (no project needed)."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.checks.gated import Gated, gated
from grpo.config import config_from_dict
from grpo.data.prepare import build_records
from grpo.model.lora import wrap_lora
from grpo.model.precision import fp32_head
from grpo.train.policy import Policy
from grpo.train.step import build_step

CFG = config_from_dict({"grpo": {"group_size": 2, "sampling": {"max_new_tokens": 4}},
                        "model": {"lora": {"r": 2, "alpha": 4}}})
FULL = config_from_dict({**CFG.model_dump(mode="json"),
                         "model": {**CFG.model.model_dump(mode="json"), "lora": {"enabled": False}}})


def random_model_for(tokenizer) -> LlamaForCausalLM:
    """A 1-layer random Llama over the tokenizer's whole vocabulary (the real families have none here), its
    head an ``Fp32Head`` as ``grpo.model.loading`` makes every model's.

    A wide initialisation keeps its next-token distribution away from uniform: at the maximum entropy
    log V no step can raise entropy, and the I7 check would have nothing to show."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         initializer_range=0.5)
    torch.manual_seed(0)
    return fp32_head(LlamaForCausalLM(config)).eval()  # as every loaded model: the head scores in place


def policy_for(cfg, model, tokenizer, reference=None) -> Policy:
    """``model`` as ``build_policy`` makes the GRPO policy: a LoRA adapter (or every weight against
    ``reference``), AdamW at ``grpo.lr``, a constant schedule."""
    if cfg.model.lora.enabled:
        torch.manual_seed(cfg.seed)
        model = wrap_lora(model, cfg.model.lora)
    model = model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.grpo.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Policy(model, tokenizer, optimizer, scheduler, reference)


def subject_for(cfg, model, tokenizer, records, sft=None, base=None, reference=None) -> Gated:
    """The gate's step around ``model`` as the GRPO policy (``build_step``), a copy as the fresh SFT weights."""
    sft = copy.deepcopy(model) if sft is None else sft
    step = build_step(cfg, policy_for(cfg, model, tokenizer, reference), Accelerator(cpu=True))
    return gated(cfg, step, records, sft.eval(), base)


def train_records() -> list[dict]:
    """Twelve generated train records of both tasks, as the gate's probes read them."""
    cfg = config_from_dict({"data": {"n_train": 12, "n_eval": 4}})
    return [r.model_dump(mode="json") for r in build_records(cfg)["train"]]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """``train_records()`` once per test module (the gate tests import it as their ``records`` fixture)."""
    return train_records()


@pytest.fixture
def subject(tiny_tokenizer, records) -> Gated:
    """The gate's view of a fresh random model over ``records`` (a fixture the gate tests import)."""
    return subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, records)
