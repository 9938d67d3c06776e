"""The update's policy pass reuses the rollout's prefill of the prompts, for its own pass over them.

The rollout prefills each prompt with the policy's weights, and with ``num_iterations: 1`` the update
scores with the very same weights, so the rollout keeps that prefill's keys and values with their autograd
graph (``core.prefix.keep_prefills``, one graph per task, as the update runs one backward per task) and
the policy pass runs only the last prompt column and the completions against them; the update's
gradients flow back through the kept graph. A kept prefill records which weights (and their in-place
versions) it was computed with and refuses any other (``core.prefix.PrefillError``).

It applies only where a fresh pass would be the very same computation (``prefill_reusable``); elsewhere,
and under ``model.fast_paths: off``, the policy pass runs the prompts itself, the library's way
(``tests/test_step.py`` compares the two steps' numbers).
"""

from __future__ import annotations

import torch

from grpo.config import GrpoConfig
from grpo.core.attention import takes_prepared_mask

DROPOUT_RATES = ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of ``model`` is random: a dropout module with p > 0 (LoRA's
    included) or a dropout rate in its config that attention applies in training."""
    config = getattr(model, "config", None)
    rates = [getattr(config, name, 0.0) for name in DROPOUT_RATES]
    return any(isinstance(r, (int, float)) and r > 0 for r in rates) or any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )


def prefill_reusable(
    grpo: GrpoConfig, model: torch.nn.Module, *, shares_prefix: bool, samples_on_model: bool, one_process: bool
) -> bool:
    """Whether the update's policy pass may reuse the rollout's prefill: only where a fresh pass would be the
    very same computation and each prompt's graph is traversed by the backward of its own task once. So:
    the prompt scored once (``shares_prefix``) and ``grpo.reuse_prefill``, the trainer's model samples
    (``samples_on_model``: the hf engine), one optimizer step on one micro-batch per rollout (the weights
    are the rollout's), the groups trained as drawn (dynamic sampling's selections drop the kept prefill),
    one unsharded process (``one_process``: DDP and FSDP wrap the forward the update runs), a
    full-attention model that takes the prepared 4D mask, and no dropout (the rollout runs in eval mode,
    the update in train mode)."""
    return (
        shares_prefix
        and grpo.reuse_prefill
        and samples_on_model
        and grpo.num_iterations == 1
        and grpo.grad_accum == 1
        and grpo.dynamic_sampling == "none"
        and one_process
        and takes_prepared_mask(model)
        and not has_dropout(model)
    )
