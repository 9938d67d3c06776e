"""Scoring a rollout: the one path from sampled ids to log-probs, for the step, the gate and the diagnosis.

``rollout_inputs`` joins the generated ids to their prompts (I3: never re-tokenised) and carries the
temperature the rollout recorded; ``score_inputs`` scores them under that temperature (I10) with the
policy's adapter on, or off for the reference (I9: the SFT weights themselves, not the base model);
``score_reference`` is the one place that picks the reference: the frozen SFT copy under full
fine-tuning, the adapter disabled under LoRA.
Nothing here reads ``grpo.sampling.temperature``: a scorer cannot disagree with the sampler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from grpo.core.batching import join_prompt_completion
from grpo.core.logprobs import Scored, score_completions
from grpo.core.prefix import PromptPrefill
from grpo.errors import GrpoError
from grpo.model.lora import adapter_disabled
from grpo.model.rollout import Rollout


class MissingReferenceError(GrpoError):
    """A model was asked for a reference it does not have."""


@dataclass(frozen=True)
class RolloutInputs:
    """A rollout joined into model inputs, with the distribution it was sampled from."""

    input_ids: torch.Tensor  # [N, P + C] left-padded prompt ids, then the generated ids
    attention_mask: torch.Tensor  # [N, P + C] 1 = real token
    completion_mask: torch.Tensor  # [N, C] bool, up to and including the first stop token
    temperature: float  # the rollout's sampling temperature

    def rows(self, index: torch.Tensor) -> RolloutInputs:
        """The rows ``index`` [n] of every tensor."""
        return RolloutInputs(
            self.input_ids[index], self.attention_mask[index], self.completion_mask[index], self.temperature
        )


def rollout_inputs(rollout: Rollout, device: torch.device | str = "cpu") -> RolloutInputs:
    """Join the rollout's prompt and generated ids (I3, I11) on ``device``."""
    joined = join_prompt_completion(
        rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask
    )
    return RolloutInputs(
        joined.input_ids.to(device),
        joined.attention_mask.to(device),
        rollout.completion_mask.to(device),
        rollout.temperature,
    )


def score_inputs(
    model: torch.nn.Module,
    inputs: RolloutInputs,
    adapter: bool = True,
    shared_prefix: bool = False,
    prefills: Sequence[PromptPrefill] = (),
    segments: Sequence[Hashable] | None = None,
    logprobs_only: bool = False,
    entropy_grad: bool = True,
    full_logits: bool = False,
) -> Scored:
    """Log-probs and entropy of the completions under ``softmax(z / inputs.temperature)``.

    ``adapter=False`` scores the reference (I9): the same peft model with its LoRA adapter disabled.
    ``shared_prefix``: each distinct prompt runs once and its completions against its cache (exact);
    ``prefills``: the rollout's kept prefills of the prompts stand in for that prompt pass (``core.prefix``);
    ``segments``: a label per row (its task), one prefill forward each (``core.prefix.shared_prefix_forward``);
    ``logprobs_only``: the log-probs alone, the same numbers; ``entropy_grad``: whether a gradient may reach
    the entropy; ``full_logits``: from the full logits, not chunk by chunk in the head
    (``core.logprobs.score_completions``).
    """
    context = contextlib.nullcontext() if adapter else adapter_disabled(model)
    with context:
        return score_completions(
            model,
            inputs.input_ids,
            inputs.attention_mask,
            inputs.completion_mask.shape[1],
            inputs.temperature,
            shared_prefix=shared_prefix,
            prefills=prefills,
            segments=segments,
            logprobs_only=logprobs_only,
            entropy_grad=entropy_grad,
            full_logits=full_logits,
        )


def score_reference(
    model: torch.nn.Module,
    inputs: RolloutInputs,
    reference: torch.nn.Module | None = None,
    shared_prefix: bool = False,
    segments: Sequence[Hashable] | None = None,
    logprobs_only: bool = False,
    full_logits: bool = False,
) -> Scored:
    """The reference's log-probs and entropy (I9): ``reference`` (the frozen SFT copy that full
    fine-tuning keeps) when given, else ``model`` with its LoRA adapter disabled."""
    if reference is not None:
        return score_inputs(
            reference,
            inputs,
            shared_prefix=shared_prefix,
            segments=segments,
            logprobs_only=logprobs_only,
            full_logits=full_logits,
        )
    if not hasattr(model, "disable_adapter"):
        raise MissingReferenceError(
            f"the reference of a {type(model).__name__} without a LoRA adapter is a frozen copy of the SFT "
            "model, and none was given: pass train.policy.build_policy's `reference` (model.lora.enabled: false)"
        )
    return score_inputs(
        model,
        inputs,
        adapter=False,
        shared_prefix=shared_prefix,
        segments=segments,
        logprobs_only=logprobs_only,
        full_logits=full_logits,
    )
