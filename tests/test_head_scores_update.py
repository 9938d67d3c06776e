"""grpo/core/head_scores.py through the GRPO update: the trainer's update scored in the head equals the
full-logits update (stored old and reference log-probs, the policy pass, statistics, losses, KL and the
combined gradient) in every loss type and multitask mode, LoRA and full fine-tuning, and it never holds the
``[B, C, V]`` logits."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.config import config_from_dict
from grpo.model.precision import fp32_head
from grpo.train.policy import Policy, frozen_copy
from grpo.train.step import build_step, draw, prepare_batch
from grpo.train.update import global_totals, gradient
from tests.steps import make_step, step_records, with_advantages
from tests.test_head_scores import small_chunks


@pytest.fixture(scope="module")
def records():
    return step_records()


def make_full_step(tiny_model, tiny_tokenizer, **grpo):
    """The step around the tiny model under full fine-tuning (tied head trainable; a frozen SFT copy)."""
    cfg = config_from_dict({"grpo": {"group_size": 2, "sampling": {"max_new_tokens": 5}, **grpo},
                            "model": {"lora": {"enabled": False}}})
    model = tiny_model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy = Policy(model, tiny_tokenizer, optimizer, scheduler, frozen_copy(model))
    return build_step(cfg, policy, Accelerator(cpu=True))


def drawn(tiny_model, tiny_tokenizer, records, full_logits: bool, lora: bool = True, **grpo):
    """The step (LoRA moved off zero, or full fine-tuning) and one rollout of ``records``."""
    model = copy.deepcopy(tiny_model)
    if lora:
        step = make_step(model, tiny_tokenizer, full_logits=full_logits, num_iterations=2, **grpo)
        with torch.no_grad():
            for name, param in step.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    else:
        step = make_full_step(model, tiny_tokenizer, full_logits=full_logits, num_iterations=2, **grpo)
    sampled = draw(step, records, seed=5)
    return step, with_advantages(sampled, torch.linspace(-1, 1, len(sampled.rewards)))


def scored_update(step, sampled):
    """The stored old and reference log-probs, and the update's first gradient pass."""
    batch = prepare_batch(step, sampled)
    return batch, gradient(step, batch, global_totals(step, batch))


def update_pass(tiny_model, tiny_tokenizer, records, full_logits: bool, lora: bool = True, **grpo):
    return scored_update(*drawn(tiny_model, tiny_tokenizer, records, full_logits, lora, **grpo))


def assert_same_update(got, want):
    (got_batch, got_pass), (want_batch, want_pass) = got, want
    assert torch.equal(got_batch.inputs.input_ids, want_batch.inputs.input_ids)  # the same rollout
    for name in ("old_logprobs", "ref_logprobs"):
        torch.testing.assert_close(getattr(got_batch, name), getattr(want_batch, name), rtol=0, atol=1e-5)
    for got_part, want_part in zip(got_pass.scored, want_pass.scored, strict=True):
        torch.testing.assert_close(got_part.logprobs, want_part.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_part.entropy, want_part.entropy, rtol=0, atol=1e-5)
    assert got_pass.task_stats.keys() == want_pass.task_stats.keys()
    for task, stats in want_pass.task_stats.items():
        assert "logits/top5_mass" in stats and stats.keys() == got_pass.task_stats[task].keys()
        for key, value in stats.items():
            assert got_pass.task_stats[task][key] == pytest.approx(value, abs=1e-5), (task, key)
    for key, value in want_pass.stats.items():
        assert got_pass.stats[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert want_pass.direction.abs().max() > 1e-3
    torch.testing.assert_close(got_pass.direction, want_pass.direction, rtol=1e-5, atol=1e-5)


UPDATE_CASES = [  # (loss_type, multitask, grad_accum, entropy_coef)
    ("grpo", {"mode": "cagrad"}, 1, 0.01),
    ("dr_grpo", {"mode": "cagrad"}, 1, 0.01),
    ("token_mean", {"mode": "cagrad"}, 1, 0.01),
    ("grpo", {"mode": "sum"}, 1, 0.0),
    ("grpo", {"mode": "sum", "task_stats": True}, 2, 0.01),
    ("token_mean", {"mode": "pcgrad"}, 1, 0.01),
    ("grpo", {"mode": "pcgrad", "reward_only": True}, 1, 0.01),
    ("dr_grpo", {"mode": "cagrad", "reward_only": True}, 2, 0.0),
    ("grpo", {"mode": "cagrad", "low_memory": False}, 1, 0.01),
    ("token_mean", {"mode": "cagrad", "low_memory": False, "reward_only": True}, 2, -0.01),
    ("grpo", {"mode": "sum", "low_memory": False}, 2, 0.0),
]


@pytest.mark.parametrize(("loss_type", "multitask", "grad_accum", "entropy_coef"), UPDATE_CASES)
def test_the_update_equals_the_full_logits_update(tiny_model, tiny_tokenizer, records, monkeypatch, loss_type,
                                                  multitask, grad_accum, entropy_coef):
    """The trainer's update (``update.gradient``) with ``grpo.full_logits`` off and on: the same stored old
    and reference log-probs, the same policy pass, statistics, losses and KL, the same combined gradient,
    in every loss type and multitask mode, with the rollout's kept prefill, at T != 1, in chunks of 3."""
    small_chunks(monkeypatch, 3, tiny_model.config.vocab_size)
    grpo = {"loss": {"loss_type": loss_type, "beta": 0.04, "entropy_coef": entropy_coef}, "multitask": multitask,
            "grad_accum": grad_accum, "sampling": {"max_new_tokens": 5, "temperature": 0.8}}
    assert_same_update(update_pass(tiny_model, tiny_tokenizer, records, False, **grpo),
                       update_pass(tiny_model, tiny_tokenizer, records, True, **grpo))


@pytest.mark.parametrize("multitask", [{"mode": "cagrad"}, {"mode": "sum"}])
def test_the_full_fine_tuning_update_equals_the_full_logits_update(tiny_model, tiny_tokenizer, records,
                                                                   monkeypatch, multitask):
    """Full fine-tuning: the tied head is trainable (its gradient from recomputed chunks), the reference a
    frozen copy (scored in the head, log-probs only)."""
    small_chunks(monkeypatch, 3, tiny_model.config.vocab_size)
    grpo = {"loss": {"beta": 0.04, "entropy_coef": 0.01}, "multitask": multitask,
            "sampling": {"max_new_tokens": 5, "temperature": 1.3}}
    assert_same_update(update_pass(tiny_model, tiny_tokenizer, records, False, lora=False, **grpo),
                       update_pass(tiny_model, tiny_tokenizer, records, True, lora=False, **grpo))


# --------------------------------------------------------------------------- memory


class LargestOutput(TorchDispatchMode):
    """The largest storage (bytes) any op's output has while active, forward and backward (a view reports
    its base's storage, which the op that made it produced)."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.op = tensor.untyped_storage().nbytes(), str(func)
        return out


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_update_never_holds_the_full_logits(tiny_model, tiny_tokenizer, records, monkeypatch, lora):
    """A real GRPO update (the stored old and reference log-probs, the update's pass and its backward) on
    a Llama whose vocabulary (32768) dwarfs its width (16): no op produces a tensor an eighth the size of the
    fp32 ``[B, C, V]`` logits when scored in the head, in chunks of 8 positions; with ``full_logits`` some op
    produces the whole logits (the guard bites)."""
    vocab = 32768
    config = LlamaConfig(**{**tiny_model.config.to_dict(), "vocab_size": vocab, "hidden_size": 16,
                            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 1})
    torch.manual_seed(0)
    model = fp32_head(LlamaForCausalLM(config))
    small_chunks(monkeypatch, 8, vocab)
    seen = {}
    for full_logits in (False, True):
        grpo = {"group_size": 4, "loss": {"beta": 0.04, "entropy_coef": 0.01},
                "multitask": {"mode": "cagrad", "low_memory": False},  # one pass over all 16 rows
                "sampling": {"max_new_tokens": 24}}
        step, sampled = drawn(model, tiny_tokenizer, records, full_logits, lora=lora, **grpo)
        with LargestOutput() as largest:
            batch, taken = scored_update(step, sampled)
        rows, width = batch.completion_mask.shape
        assert rows == 16 and width >= 16 and taken.direction.abs().max() > 0
        seen[full_logits] = (largest.nbytes, largest.op, 4 * rows * width * vocab)
    nbytes, op, logits = seen[False]
    assert nbytes < logits / 8, (op, nbytes, logits)
    assert seen[True][0] >= logits, seen[True]
