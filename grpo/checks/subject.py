"""What the pre-flight checks run on: the GRPO step's own context around the configured policy.

The checks call the stage functions through it (``draw``, ``prepare_batch``, the rollout and the
scorer), so what they prove is proven on the code the stages run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from grpo.config import Config
from grpo.data.prompts import example_messages
from grpo.model.chat import render_prompt
from grpo.model.precision import autocast_enabled
from grpo.model.rollout import stop_ids
from grpo.train.step import ScoredBatch, StepContext, draw, prepare_batch


@dataclass
class Subject:
    """What the checks run on: the GRPO step's context around the policy, and the models to compare with."""

    ctx: StepContext  # the configured policy (LoRA on the SFT weights, or all of them) and its reference
    records: list[dict]  # one per task, prompt widths as different as possible, shortest first
    sft: torch.nn.Module  # a fresh load of the SFT weights: the reference must equal it (I9)
    base: torch.nn.Module | None  # the pre-SFT base: the reference must differ from it (None: not compared)

    @property
    def cfg(self) -> Config:
        return self.ctx.cfg

    @property
    def policy(self) -> torch.nn.Module:
        return self.ctx.model

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen SFT copy (full fine-tuning), or None: the policy with its adapter disabled (I9)."""
        return self.ctx.reference

    @property
    def tokenizer(self) -> Any:
        return self.ctx.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return self.ctx.eos_ids

    @property
    def prompts(self) -> list[list[int]]:
        kwargs = self.cfg.model.chat_template_kwargs
        return [render_prompt(self.tokenizer, example_messages(r), **kwargs) for r in self.records]

    def tolerance(self, logit_scale: float | None = None) -> float:
        """Log-prob agreement expected of two scorings of the same ids: 1e-4 for fp32 weights, 5e-2 for
        bf16 weights. A check that scores in the step's precision passes ``logit_scale``, the largest
        scaled logit max |z / T| it compared: under ``grpo.bf16`` autocast a logit z is known to about
        |z| * 2^-8 (8 mantissa bits; two kernel paths were measured to differ by 0.6-1 such step), so
        the bound is 2 such steps (1e-3 at least): it scales with the logits, so near-uniform logits
        (where a wrong temperature moves little) get a bound as tight as their noise."""
        if next(self.policy.parameters()).dtype != torch.float32:
            return 5e-2
        if logit_scale is None or not autocast_enabled(self.ctx.accelerator.device, self.cfg.grpo.bf16):
            return 1e-4
        return max(1e-3, 2 * 2**-8 * logit_scale)


def with_grpo(ctx: StepContext, **grpo: Any) -> StepContext:
    """``ctx`` with some ``grpo`` params replaced (``sampling`` as a dict of its fields)."""
    sampling = ctx.cfg.grpo.sampling.model_copy(update=grpo.pop("sampling", {}))
    loss = ctx.cfg.grpo.loss.model_copy(update=grpo.pop("loss", {}))
    cfg = ctx.cfg.model_copy(update={"grpo": ctx.cfg.grpo.model_copy(update={**grpo, "sampling": sampling,
                                                                              "loss": loss})})
    return dataclasses.replace(ctx, cfg=cfg)


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


def step_batch(s: Subject, seed: int, **grpo: Any) -> tuple[ScoredBatch, Any]:
    """One ``draw`` and ``prepare_batch`` of the GRPO step over the subject's records."""
    ctx = with_grpo(s.ctx, **grpo)
    sampled = draw(ctx, s.records, seed)
    return prepare_batch(ctx, sampled), sampled


def _records(cfg: Config, tokenizer, records: list[dict]) -> list[dict]:
    """One record per task, chosen so the two prompt widths differ as much as possible, shortest first
    (the shorter one is the row left padding shifts, where a wrong cut lands in prompt text)."""
    kwargs = cfg.model.chat_template_kwargs

    def rendered(task: str) -> list[tuple[int, dict]]:
        return [(len(render_prompt(tokenizer, example_messages(r), **kwargs)), r)
                for r in [r for r in records if r["task"] == task][:5]]

    pools = [pool for pool in (rendered("fairness"), rendered("hallucination")) if pool]
    if len(pools) == 2:
        chosen = list(max(((a, b) for a in pools[0] for b in pools[1]), key=lambda pair: abs(pair[0][0] - pair[1][0])))
    else:
        chosen = sorted(pools[0], key=lambda item: item[0])[:: max(1, len(pools[0]) - 1)][:2]
    chosen.sort(key=lambda item: item[0])
    return [r for _, r in chosen]


def make_subject(cfg: Config, policy: torch.nn.Module, tokenizer, records: list[dict], sft: torch.nn.Module,
                 base: torch.nn.Module | None = None, reference: torch.nn.Module | None = None) -> Subject:
    """The step's context around ``policy`` and its ``reference``, as ``train.policy.build_policy``
    makes them (LoRA on the SFT model and None: the adapter disabled; or the whole SFT model and a
    frozen copy of it); ``sft`` is a separately loaded copy of its weights, ``base`` the pre-SFT model."""
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    policy = policy.to(accelerator.device)
    reference = None if reference is None else reference.to(accelerator.device)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)  # the checks never step through it
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    eos_ids = stop_ids(policy, tokenizer, cfg.model.extra_stop_tokens)
    ctx = StepContext(cfg, policy, tokenizer, optimizer, scheduler, eos_ids, accelerator, reference=reference)
    return Subject(ctx, _records(cfg, tokenizer, records), sft, base)
