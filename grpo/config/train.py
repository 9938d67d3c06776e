"""``pretrain``, ``sft``, ``grpo`` and ``checkpoint``: how the three training stages run (``grpo/train/``)."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, field_validator

from grpo.config.base import Section


class OptimizerConfig(Section):
    epochs: int = Field(2, ge=1)
    """Passes over the training examples."""
    batch_size: int = Field(16, ge=1)
    """Conversations per optimizer step."""
    lr: float = Field(2e-3, gt=0.0)
    """Peak AdamW learning rate (linear warmup, then linear decay). The embedded model's default: a
    pretrained model wants 1e-5 to 2e-4 (LoRA the upper end)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Share of the optimizer steps spent warming the learning rate up, in [0, 1]."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    bf16: bool = False
    """bf16 autocast of the forward pass over fp32 master weights and optimizer state, on GPU and on a CPU
    with native bf16 (AVX512-BF16/AMX; elsewhere fp32, ``grpo/model/precision.py``); the LM head stays fp32."""
    group_by_length: bool = False
    """Batch examples of similar length: each epoch's shuffled order is cut into chunks of 50 batches,
    each chunk sorted by length into batches, and the batches shuffled (less padding in a batch). Off, a
    batch pads to its longest of randomly drawn examples."""


class SftConfig(OptimizerConfig):
    max_length: int = Field(512, ge=16)
    """Conversations longer than this (prompt + answer tokens) are an error, not silently cut."""
    lora: bool = False
    """SFT through a LoRA adapter (sizes from model.lora) merged into the weights afterwards: the SFT
    model is full weights either way. Independent of model.lora.enabled, which decides how GRPO trains."""


class PretrainConfig(OptimizerConfig):
    records: int = Field(20000, ge=0)
    """Generated training-split records the embedded model learns, loss on every token, in the ``base``
    stage (``grpo/train/pretrain.py``); 0 leaves it with random weights. Other models ignore it."""
    epochs: int = Field(4, ge=1)
    """Passes over the pretraining records."""
    lr: float = Field(3e-3, gt=0.0)
    """Peak AdamW learning rate of pretraining."""
    group_by_length: bool = True
    """Batch records of similar length (see ``sft.group_by_length``): the chat-rendered fairness records
    are about three times as long as the plain texts, so random batches would be half padding."""
    fairness_fraction: float | None = Field(0.3, ge=0.0, le=1.0)
    """Share of fairness records among ``records``, in [0, 1]; null: ``data.fairness_fraction``."""
    chat_tasks: list[Literal["fairness", "hallucination"]] = Field(default_factory=lambda: ["fairness"])
    """Tasks whose pretraining records are the chat conversation SFT and GRPO render (system turn, user
    turn with its instruction, the answer; loss on every token) instead of the plain text: a small model
    reads only in the layout it was pretrained in."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (> 0); log-probs and entropy use the same scaled distribution (I10)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass, in (0, 1]; below 1 the sampled distribution is not the scored one (I10)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables it."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest completion."""
    min_new_tokens: int = Field(1, ge=0)
    """EOS is suppressed until this many completion tokens exist (counted on the completion only)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the completion (never the prompt)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of tokens already in the completion."""

    @field_validator("temperature", mode="before")
    @classmethod
    def _positive_temperature(cls, value: Any) -> Any:
        if isinstance(value, int | float) and value <= 0:
            raise ValueError(
                "must be > 0: it divides the logits; use a small value such as 0.1 for near-greedy sampling"
            )
        return value


class LossConfig(Section):
    loss_type: Literal["grpo", "dr_grpo", "token_mean"] = "grpo"
    """Aggregation over tokens: per-sequence mean, Dr. GRPO constant length, or DAPO token mean."""
    epsilon_low: float = Field(0.2, ge=0.0)
    """Lower clip range of the ratio (1 - epsilon_low)."""
    epsilon_high: float = Field(0.28, ge=0.0)
    """Upper clip range of the ratio (1 + epsilon_high; DAPO clip-higher)."""
    beta: float = Field(0.04, ge=0.0)
    """Weight of the per-token k3 KL to the reference (the SFT policy)."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef * entropy (negative values push entropy down)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group std, the batch std (the global batch's over processes, each
    process's own under ``dynamic_sampling: resample``), or nothing."""


class MultitaskConfig(Section):
    mode: Literal["sum", "pcgrad", "cagrad"] = "cagrad"
    """How the fairness and hallucination gradients are combined."""
    cagrad_c: float = Field(0.5, ge=0.0)
    """CAGrad conflict radius c (0 gives the mean gradient)."""
    cagrad_rescale: Literal[0, 1, 2] = 1
    """CAGrad rescale: 0 none, 1 divide by 1 + c^2, 2 divide by 1 + c."""
    reward_only: bool = False
    """Combine only the policy-gradient parts; KL and entropy gradients are added unchanged."""
    low_memory: bool = True
    """One graph per task's rows (each task's backward covers only its own rows); false: one graph over
    all rows and each task's gradient through it, a full-batch backward each."""
    task_stats: bool = False
    """``sum`` mode: also take each task's gradient (grad_norm/<task>, grad_cos) at one backward per
    task; off, sum mode takes one backward of the summed loss. The other modes always need them."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: ``hf``, the trainer's own model (Hugging Face ``generate``'s tokens, through its fast
    stand-in where ``model.fast_paths`` allows; CUDA graphs of the decode step on a GPU), or vLLM colocated on
    the same GPU (untested: it has never run on this project's machines)."""
    gpu_memory_utilization: float = Field(0.3, gt=0.0, lt=1.0)
    """vLLM: share of the GPU memory its weights and KV cache may take (the trainer keeps the rest)."""
    sleep: bool = True
    """vLLM: release its GPU memory between rollouts (sleep mode) so the training phase gets it back."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: per-token weight min(p_trainer / p_sampler, tis_cap) on the loss."""
    tis_threshold: float = Field(0.0, ge=0.0)
    """Apply the weights only when the batch's mean per-token |log p_trainer - log p_sampler| exceeds this."""

    @field_validator("engine")
    @classmethod
    def _vllm_installed(cls, value: str) -> str:
        if value == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "is 'vllm' but vLLM is not installed: install the extra with pip install -e '.[vllm]' "
                "(needs a CUDA GPU), or use the default engine hf"
            )
        return value


class SelectionConfig(Section):
    rule: Literal["worst_kind", "last"] = "worst_kind"
    """Which checkpoint becomes models/grpo. ``worst_kind``: of the evaluated checkpoints, the one whose worst
    kind of item changed most favourably against the SFT model on the validation split (ties: the larger mean
    change, then the later step), so a gain on one kind bought with a loss on another cannot win. ``last``:
    the last step, with no validation split and no evaluation (``grpo train --select last``)."""
    every: int = Field(10, ge=1)
    """Steps between greedy evaluations of the validation split (the last step is always evaluated); every
    evaluated step is checkpointed, and the best one is kept whatever checkpoint.keep_last says. Each
    evaluation of 64 records costs about one step's time on the embedded model."""
    records: int = Field(64, ge=4)
    """Validation records set aside from GRPO's training prompts (never eval items), in equal shares of each
    kind of item; GRPO never samples them."""


class GrpoConfig(Section):
    group_size: int = 4
    """Completions sampled per prompt (G, at least 2)."""
    steps: int = Field(40, ge=1)
    """Optimizer steps of GRPO."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step (each gets group_size completions), split across processes."""
    fairness_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of fairness prompts in every batch (the rest is hallucination)."""
    kind_share: float | None = Field(None, ge=0.0, le=1.0)
    """Share of each task's prompts in every batch whose context answers (disambiguated, answerable; the
    rest ambiguous, unanswerable), each kind drawn uniformly; null draws each task's prompts as its data falls."""
    lr: float = Field(2e-3, gt=0.0)
    """AdamW learning rate of the policy (constant after warmup). The embedded model's default: a
    pretrained model's LoRA wants about 1e-5 to 5e-5."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warmup steps."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Clipping norm of the combined gradient."""
    num_iterations: int = Field(1, ge=1)
    """Updates per rollout; from the second one the stored old log-probs make the ratio differ from 1."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step (per-task gradients are accumulated, then combined once)."""
    dynamic_sampling: Literal["none", "filter", "resample"] = "none"
    """Zero-variance groups: keep them (advantage 0), drop them, or draw new prompts (DAPO)."""
    max_resample: int = Field(2, ge=0)
    """Extra rollouts per step when dynamic_sampling is resample."""
    bf16: bool = False
    """bf16 autocast of generation and scoring over fp32 master weights, on GPU and on a CPU with native
    bf16 (AVX512-BF16/AMX; elsewhere fp32); the LM head, log-probs, entropy, losses and KL in fp32."""
    shared_prefix: bool = True
    """Score each distinct prompt once and its G completions against its key/value cache (the same
    log-probs, entropy and gradients as a forward over every row, without recomputing the prompt)."""
    full_logits: bool = False
    """Score log-probs and entropy from the whole [rows x tokens x vocabulary] fp32 logits with autograd
    through them: the readable path the default one (chunk by chunk of positions in the LM head, the full
    logits never held, forward or backward) is tested against; far more memory on a large vocabulary."""
    reuse_prefill: bool = True
    """With shared_prefix: the update's policy pass reuses the rollout's prefill of the prompts (kept with
    its graph) instead of running them again, where that is the same computation (``Step.reuses_prefill``)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout engine (hf or vllm) and the correction of its sampling/training mismatch."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Policy loss."""
    multitask: MultitaskConfig = Field(default_factory=MultitaskConfig)
    """Combination of per-task gradients."""
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    """Which checkpoint becomes models/grpo, chosen on a validation split (``grpo/train/selection.py``)."""

    @field_validator("group_size")
    @classmethod
    def _group_of_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "must be >= 2: GRPO needs at least two completions per prompt to compute an advantage"
            )
        return value


class CheckpointConfig(Section):
    every: int = Field(5, ge=1)
    """Optimizer steps between checkpoints."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones and stale temporary directories are deleted."""
    resume: bool = True
    """Continue from the newest complete checkpoint of the run when one exists."""
