"""The trainer's step as the pre-flight gate checks it: made by the trainer's own construction.

``gate_step`` builds the policy with ``train.policy.build_policy`` and the step with
``train.step.build_step``, exactly as ``train.trainer.train`` does (the trainer's modules are in the
pre-flight's fingerprint, so a change to how it wires the step re-runs the gate), picks probe records and
loads what the checks compare with: a fresh load of the SFT weights (the reference must be them, I9) and
the pre-SFT base (it must differ from them). Every check drives the step's own functions through it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from grpo import paths
from grpo.config import Config
from grpo.data.prompts import example_messages, render_records
from grpo.data.select import balanced_records, eval_records, train_records
from grpo.model.chat import render_prompt, special_ids
from grpo.model.device import make_accelerator
from grpo.model.loading import load_model
from grpo.model.stage_models import load_base
from grpo.train.policy import frozen_copy
from grpo.train.step import build_step, build_training, draw, prepare_batch
from grpo.train.step_types import ScoredBatch, Step


@dataclass
class Gated:
    """What the checks run on: the trainer's step around the configured policy, and the models to compare with."""

    step: Step  # the configured policy (LoRA on the SFT weights, or all of them), its reference and optimizer
    records: list[dict]  # one per task, prompt widths as different as possible, shortest first
    sft: torch.nn.Module  # a fresh load of the SFT weights: the reference must equal it (I9)
    base: torch.nn.Module | None  # the pre-SFT base: the reference must differ from it (None: not compared)
    questions: list[dict]  # eval records the SFT model must answer, ending its answers (I2)

    @property
    def cfg(self) -> Config:
        return self.step.cfg

    @property
    def policy(self) -> torch.nn.Module:
        return self.step.model

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen SFT copy (full fine-tuning), or None: the policy with its adapter disabled (I9)."""
        return self.step.reference

    @property
    def tokenizer(self) -> Any:
        return self.step.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return self.step.eos_ids

    @property
    def prompts(self) -> list[list[int]]:
        kwargs = self.cfg.model.chat_template_kwargs
        return render_records(self.tokenizer, self.records, kwargs)

    def variant(self, **grpo: Any) -> Step:
        """The trainer's step built again with some ``grpo`` params replaced (``with_grpo``)."""
        return with_grpo(self.step, **grpo)

    def tolerance(self) -> float:
        """Log-prob agreement expected of two scorings of the same ids through the same path (the
        checks compare in the step's precision on the same kernels, or in fp32): 1e-4 for fp32 weights,
        5e-2 for weights loaded in bf16 (``model.dtype: bfloat16``)."""
        return 1e-4 if next(self.policy.parameters()).dtype == torch.float32 else 5e-2


@contextlib.contextmanager
def restored(step: Step) -> Iterator[None]:
    """Run the step's real optimizer inside; its trainable weights, optimizer and scheduler state are put
    back exactly as they were on exit (the gate trains nothing)."""
    weights = [p.detach().clone() for p in step.params]
    optimizer, scheduler = (
        copy.deepcopy(step.optimizer.state_dict()),
        copy.deepcopy(step.scheduler.state_dict()),
    )
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(step.params, weights, strict=True):
                param.copy_(value)
        step.optimizer.load_state_dict(optimizer)
        step.scheduler.load_state_dict(scheduler)
        step.model.zero_grad(set_to_none=True)


def pad_not_stop(tokenizer: Any, eos_ids: list[int]) -> Any | None:
    """A copy of ``tokenizer`` whose pad token is a special token that ends no completion (None when its
    pad is no stop token already, or it has no such token): the decode loop then writes non-stop ids after
    a row's stop token, where a mask that reads ids instead of positions runs on (I5)."""
    if tokenizer.pad_token_id not in eos_ids:
        return None
    spare = sorted(special_ids(tokenizer) - set(eos_ids))
    if not spare:
        return None
    copied = copy.deepcopy(tokenizer)
    copied.pad_token = copied.convert_ids_to_tokens(spare[0])
    return copied


def with_grpo(step: Step, **grpo: Any) -> Step:
    """``step`` built again with some ``grpo`` params replaced (``sampling`` as a dict of its fields)."""
    sampling = step.cfg.grpo.sampling.model_copy(update=grpo.pop("sampling", {}))
    loss = step.cfg.grpo.loss.model_copy(update=grpo.pop("loss", {}))
    cfg = step.cfg.model_copy(
        update={"grpo": step.cfg.grpo.model_copy(update={**grpo, "sampling": sampling, "loss": loss})}
    )
    return build_step(cfg, step.policy, step.accelerator)


def _noise(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Seeded standard normal noise of ``p``'s shape, on its device and in its dtype."""
    return torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)


@contextlib.contextmanager
def perturbed_policy(model: torch.nn.Module, seed: int, scale: float = 0.05):
    """The policy moved away from the SFT weights by seeded noise, restored bit-exactly on exit: at
    the SFT weights ratio 1 and KL 0 would hold whatever the code did.

    LoRA: the B matrices (0 in a fresh adapter) set to noise of std ``scale``. Full fine-tuning: every
    trainable weight plus noise of ``scale`` times that weight's own std (its mean |w| where the std is
    0, as in a norm's all-ones weight), so each layer moves by the same small share."""
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    moved = lora_b or [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in moved]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved:
            if lora_b:
                p.copy_(_noise(p, generator) * scale)
            else:
                spread = p.float().std() if p.numel() > 1 else p.new_zeros(())
                spread = spread if spread > 0 else p.float().abs().mean()
                p.add_(_noise(p, generator) * (scale * spread).to(p.dtype))
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, value in zip(moved, saved, strict=True):
                p.copy_(value)


def step_batch(s: Gated, seed: int, **grpo: Any) -> tuple[ScoredBatch, Any]:
    """One ``draw`` and ``prepare_batch`` of the GRPO step over the subject's records."""
    step = with_grpo(s.step, **grpo)
    sampled = draw(step, s.records, seed)
    return prepare_batch(step, sampled), sampled


def _records(cfg: Config, tokenizer, records: list[dict]) -> list[dict]:
    """One record per task, chosen so the two prompt widths differ as much as possible, shortest first
    (the shorter one is the row left padding shifts, where a wrong cut lands in prompt text)."""
    kwargs = cfg.model.chat_template_kwargs

    def rendered(task: str) -> list[tuple[int, dict]]:
        return [
            (len(render_prompt(tokenizer, example_messages(r), **kwargs)), r)
            for r in [r for r in records if r["task"] == task][:5]
        ]

    pools = [pool for pool in (rendered("fairness"), rendered("hallucination")) if pool]
    if len(pools) == 2:
        chosen = list(
            max(((a, b) for a in pools[0] for b in pools[1]), key=lambda pair: abs(pair[0][0] - pair[1][0]))
        )
    else:
        chosen = sorted(pools[0], key=lambda item: item[0])[:: max(1, len(pools[0]) - 1)][:2]
    chosen.sort(key=lambda item: item[0])
    return [r for _, r in chosen]


def gated(
    cfg: Config,
    step: Step,
    records: list[dict],
    sft: torch.nn.Module,
    base: torch.nn.Module | None,
    questions: list[dict] | None = None,
) -> Gated:
    """The gate's view of ``step`` (``build_step``'s: LoRA on the SFT model with the adapter disabled as its
    reference, or the whole SFT model and a frozen copy of it), on probe records drawn from ``records``;
    ``sft`` is a separately loaded copy of its weights, ``base`` the pre-SFT model, ``questions`` the eval
    records the SFT model answers (default: the probe records)."""
    if step.reference is None and not hasattr(step.model, "disable_adapter"):
        # Full fine-tuning with beta == 0 keeps no reference; the I8/I9 checks raise beta and need one.
        step = build_step(
            cfg, dataclasses.replace(step.policy, reference=frozen_copy(step.model)), step.accelerator
        )
    probes = _records(cfg, step.tokenizer, records)
    return Gated(step, probes, sft, base, probes if questions is None else questions)


def gate_step(cfg: Config) -> Gated:
    """The gate's step for ``cfg``: the trainer's own (``build_training``: the policy and the step around it),
    probe records from its training prompts, the SFT weights loaded apart, the base model."""
    accelerator = make_accelerator()
    step = build_training(cfg, accelerator)
    sft = load_model(paths.model_dir(cfg, "sft"), cfg.model).to(accelerator.device).eval()
    base = load_base(cfg)[0].to(accelerator.device).eval()
    questions = balanced_records(eval_records(cfg), cfg.eval.diagnose.prompts)
    return gated(cfg, step, train_records(cfg, "grpo"), sft, base, questions)
