"""The GRPO step's data: ``Step``, what every step reads and updates (made once by ``step.build_step``), and
``ScoredBatch``, a rollout joined into model inputs with the log-probs the loss compares against.

Apart from ``step.py`` (the step's phases) so that the phases it calls (``update.py``, ``agreement.py``)
import them at run time without importing the step itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.core.grad_space import GradSpace
from grpo.core.prefix import PromptPrefill
from grpo.model.engine_types import RolloutEngine
from grpo.model.fast import FastPaths
from grpo.model.generation import SamplerRecord
from grpo.model.precision import autocast_enabled, bf16_autocast, frozen_linears_in_bf16
from grpo.model.scoring import RolloutInputs
from grpo.train.policy import Policy


@dataclass
class Step:
    """What every step reads and updates, and the facts of the run every step uses, all made once by
    ``build_step``."""

    cfg: Config
    model: torch.nn.Module
    """The policy: a peft-wrapped model (LoRA) or the whole model (full fine-tuning)."""
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    eos_ids: list[int]
    """Every id that ends a completion (``rollout.stop_ids``)."""
    accelerator: Accelerator
    engine: RolloutEngine
    """What samples the completions (``grpo/model/engines.py``)."""
    reference: torch.nn.Module | None
    """The frozen SFT model (full fine-tuning), or None: the policy with its adapter disabled (I9)."""
    space: GradSpace
    """Where the flat gradients live: whole, or this process's FSDP shard."""
    shares_prefix: bool
    """Each prompt is scored once for its group (``grpo.shared_prefix``; not under gradient checkpointing)."""
    reuses_prefill: bool
    """The update's policy pass reuses the rollout's prefill of the prompts (``FastPaths.reuses_prefill``)."""
    header_tokens: list[str]
    """Special tokens that must never appear inside a completion (chat headers, BOS, role tags)."""
    end_of_turn_tokens: list[str]
    """The stop ids as tokens (the boundary monitor counts them)."""
    fast: FastPaths
    """The run's fast paths (``model.fast_paths``): how the rollout decodes, whether the prefill is reused."""

    @property
    def policy(self) -> Policy:
        """The policy the step was built around (to build it again with other settings)."""
        return Policy(self.model, self.tokenizer, self.optimizer, self.scheduler, self.reference)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters (LoRA's, or every weight)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def summed(self) -> bool:
        """``sum`` mode without per-task statistics: one backward of the summed loss (it is linear)."""
        mt = self.cfg.grpo.multitask
        return mt.mode == "sum" and not mt.task_stats

    def prefill_args(self, records: Sequence[Mapping]) -> dict:
        """How the engine prefills ``records``' prompts for this step: one pass per task, kept with its
        graph where the update reuses it (``RolloutEngine.generate``'s ``segments`` and ``keep_prefill``)."""
        return {"segments": [r["task"] for r in records], "keep_prefill": self.reuses_prefill}

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward passes' precision (``grpo.bf16``): bf16 autocast over fp32 weights where it pays."""
        return bf16_autocast(self.accelerator.device, self.cfg.grpo.bf16)

    def frozen_bf16(self) -> contextlib.AbstractContextManager:
        """The frozen linear weights held in bf16 for the step (``precision.frozen_linears_in_bf16``): the
        same matmuls as autocast's per-call casts, cast once (on a GPU a decode step would otherwise read
        every frozen weight twice, in fp32 and in bf16). On one process under bf16 autocast."""
        device, one = self.accelerator.device, self.accelerator.num_processes == 1
        on = device.type in ("cpu", "cuda") and one and autocast_enabled(device, self.cfg.grpo.bf16)
        return frozen_linears_in_bf16([m for m in (self.model, self.reference) if m is not None], on)



@dataclass(frozen=True)
class ScoredBatch:
    """A rollout joined into model inputs, with the stored log-probs the loss compares against."""

    inputs: RolloutInputs  # ids [N, P+C], masks, and the temperature the rollout sampled at (I10)
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None  # [N, C]; None: the current (detached) log-probs, ratio == 1
    ref_logprobs: torch.Tensor | None  # [N, C]; None when beta == 0
    rows: dict[str, torch.Tensor]  # task -> row indices [n_task], only tasks with rows
    is_weights: torch.Tensor | None = None  # [N, C] truncated IS weights; None when the trainer sampled
    prefills: tuple[
        PromptPrefill, ...
    ] = ()  # the rollout's prefill kept for the policy pass (``Step.reuses_prefill``)
    sampler: SamplerRecord | None = None  # [N, C] what the decode computed for each drawn token (``Rollout.sampler``)

    @property
    def completion_mask(self) -> torch.Tensor:  # [N, C] bool
        return self.inputs.completion_mask
