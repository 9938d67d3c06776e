"""grpo/checks/gated.py: the gate's view of the trainer's step: the reference it keeps (the adapter disabled
under LoRA, a frozen copy only for full fine-tuning), a perturbed policy put back bit for bit, the tolerance
of the policy's precision."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from grpo.checks.gated import Gated, perturbed_policy
from tests import gate_subjects
from tests.gate_subjects import FULL, random_model_for, subject_for

records, subject = gate_subjects.records, gate_subjects.subject  # the gate's fixtures, defined once


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_perturbed_policy_moves_and_is_put_back_bit_for_bit(subject, tiny_tokenizer, records):
    """LoRA: the B matrices leave 0 and return to it; full fine-tuning: every trainable weight moves and returns."""
    full = subject_for(FULL, random_model_for(tiny_tokenizer), tiny_tokenizer, records)
    for s in (subject, full):
        before = _weights(s.policy)
        with perturbed_policy(s.policy, seed=3):
            assert any(not torch.equal(a, b) for a, b in zip(before, s.policy.parameters(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(before, s.policy.parameters(), strict=True))


def test_the_lora_reference_is_the_adapter_disabled_and_full_fine_tuning_gets_a_frozen_copy(subject, tiny_tokenizer,
                                                                                              records):
    """Under LoRA the gate checks the trainer's own reference path (I9): no second model. Full fine-tuning at
    beta 0, where the trainer keeps no reference, gets a frozen copy, which the I8/I9 checks need."""
    assert subject.reference is None and hasattr(subject.policy, "disable_adapter")
    no_kl = FULL.model_copy(update={"grpo": FULL.grpo.model_copy(update={
        "loss": FULL.grpo.loss.model_copy(update={"beta": 0.0})})})
    full = subject_for(no_kl, random_model_for(tiny_tokenizer), tiny_tokenizer, records)
    assert full.reference is not None and not any(p.requires_grad for p in full.reference.parameters())


def test_the_tolerance_follows_the_policys_precision():
    def tolerance(dtype: torch.dtype) -> float:
        step = SimpleNamespace(model=torch.nn.Linear(2, 2).to(dtype))
        return Gated(step, [], None, None, []).tolerance()

    assert tolerance(torch.float32) == 1e-4 and tolerance(torch.bfloat16) == 5e-2
