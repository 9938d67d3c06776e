"""One typed configuration tree, loaded from ``params.yaml``.

Every field carries a one-line docstring (pydantic reads them as descriptions). Unknown keys are an
error that names the key and the file; a bad value is an error that names the key, the value and the
fix. Values derived from others are functions, never fields to keep in sync.
"""

from __future__ import annotations

import importlib.util
import zoneinfo
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from grpo.offline import model_source_problem

DEFAULT_PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message says how to fix it."""


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- paths


class PathsConfig(Section):
    data_dir: str = "data/processed"
    """Processed dataset folder: ``train.jsonl`` and ``eval.jsonl`` in the unified schema."""
    models_dir: str = "models"
    """Model folders: ``base/``, ``sft/``, ``grpo/``."""
    metrics_dir: str = "metrics"
    """DVC metrics JSON files."""
    reports_dir: str = "reports"
    """Human-readable reports (validation, preflight, evaluation)."""
    runs_dir: str = "runs"
    """Per-run state: checkpoints, per-step JSONL, W&B files, entropy history."""


# --------------------------------------------------------------------------- data


class DataChecksConfig(Section):
    max_context_chars: int = Field(2000, ge=1)
    """Longest context validation accepts; ``prepare`` drops longer loaded passages (and says how many)."""
    max_question_chars: int = Field(300, ge=1)
    """Longest question validation accepts."""
    max_answer_chars: int = Field(200, ge=1)
    """Longest answer (and option, distractor, SFT answer) validation accepts."""
    balance_tolerance: float = Field(0.1, ge=0.0, le=1.0)
    """Allowed gap between a share (task mix, ambiguous, negative, label position, answerable) and its target."""
    balance_z: float = Field(3.0, ge=0.0)
    """Small-split slack: the gap may also reach balance_z binomial standard errors, sqrt(p(1-p)/n)."""
    max_examples: int = Field(5, ge=1)
    """Offending rows shown per failed rule in the validation reports."""
    data_docs: bool = True
    """Also build the GX Data Docs HTML site under ``<reports_dir>/data_docs/`` (about 4 MB, half a second)."""


class DataConfig(Section):
    fairness_source: Literal["synthetic", "bbq"] = "synthetic"
    """Fairness records: the built-in BBQ-style generator, or local BBQ ``data/*.jsonl`` files."""
    fairness_path: str | None = Field(None, validate_default=True)
    """Local BBQ file or folder (required when fairness_source is bbq)."""
    hallucination_source: Literal["synthetic", "halueval", "squad2"] = "synthetic"
    """Hallucination records: the built-in grounded-QA generator, local HaluEval QA or SQuAD 2.0."""
    hallucination_path: str | None = Field(None, validate_default=True)
    """Local HaluEval QA JSON-lines file or SQuAD 2.0 JSON file (required unless synthetic)."""
    n_train: int = Field(2000, ge=1)
    """Number of training records."""
    n_eval: int = Field(120, ge=1)
    """Number of evaluation records."""
    fairness_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of fairness records in both splits (the rest is hallucination)."""
    answerable_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of answerable hallucination records in both splits."""
    sft_noise: float = Field(0.25, ge=0.0, le=1.0)
    """Share of ambiguous/unanswerable SFT targets taught the biased/hallucinated answer (the flaw GRPO removes)."""
    grpo_holdout: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the train records kept out of SFT as GRPO's prompts (``grpo.data.select.train_records``).
    0 (the default): SFT and GRPO both read every train record. Above 0, GRPO samples prompts the SFT
    model never trained on, as an RL prompt set kept apart from the SFT data (README: measured both ways)."""
    checks: DataChecksConfig = Field(default_factory=DataChecksConfig)
    """Bounds and tolerances of ``grpo validate``."""

    @field_validator("fairness_path", "hallucination_path")
    @classmethod
    def _path_matches_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        task = info.field_name.removesuffix("_path")
        source = info.data.get(f"{task}_source")  # the source is declared above the path
        if value and source == "synthetic":
            raise ValueError(
                f"is set but data.{task}_source is 'synthetic', which reads no file: set "
                f"data.{task}_source to the dataset's format, or data.{task}_path to null"
            )
        if not value and source not in (None, "synthetic"):
            raise ValueError(
                f"is needed when data.{task}_source is {source!r}: set data.{task}_path to the local file "
                f"or folder of the {source} dataset, or data.{task}_source to synthetic"
            )
        return value


# --------------------------------------------------------------------------- model

Architecture = Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.2-3b"]
"""The published architectures ``model.architecture`` can build (``grpo/model/architectures.py``)."""


class TinyModelConfig(Section):
    vocab_size: int = Field(2048, ge=300)
    """BPE vocabulary size of the embedded tokenizer (special tokens included)."""
    hidden_size: int = Field(256, ge=8)
    """Width of the embedded Llama model."""
    intermediate_size: int = Field(688, ge=8)
    """MLP width of the embedded Llama model."""
    num_hidden_layers: int = Field(4, ge=1)
    """Decoder layers of the embedded Llama model."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads of the embedded Llama model."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention) of the embedded Llama model."""
    max_position_embeddings: int = Field(1024, ge=64)
    """Longest sequence the embedded model accepts."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self


class LoraConfig(Section):
    enabled: bool = True
    """GRPO trains a LoRA adapter on the SFT weights (reference: the adapter disabled); false: GRPO
    trains every weight (full fine-tuning) and the reference is a frozen copy of the SFT model (I9)."""
    r: int = Field(8, ge=1)
    """LoRA rank."""
    alpha: int = Field(16, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get an adapter. params.yaml takes ``[v_proj, o_proj]`` for the embedded model:
    measured (README), GRPO then keeps exact match and disambiguated accuracy in every seed, where on
    all four projections it learned to abstain more and lowered them."""


class ModelConfig(Section):
    allow_download: bool = False
    """Let Hugging Face fetch a hub id that is not in the local cache; off: nothing goes online."""
    name_or_path: str | None = None
    """A local model folder or hub id (already in the local cache); null builds the embedded tiny model."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint to run; off unless you trust its source."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype at load time."""
    pad_token: str | None = None
    """Pad token to set when the tokenizer has none (e.g. ``<|finetune_right_pad_id|>``); null uses eos."""
    extra_stop_tokens: list[str] = Field(default_factory=list)
    """Tokens that end a completion besides eos and the template's end-of-turn token."""
    chat_template_kwargs: dict[str, str] = Field(default_factory=dict)
    """Extra chat-template variables, e.g. ``{date_string: 26 Jul 2024}`` for a reproducible Llama-3.2 prompt."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Sizes of the embedded default model."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter settings."""
    architecture: Architecture | None = None
    """A published architecture built with random weights and its real tokenizer (``grpo/model/architectures.py``)."""
    architecture_overrides: dict[str, int] = Field(default_factory=dict)
    """Preset numbers to change, e.g. ``{num_hidden_layers: 2}`` for a fast shrunk copy of the architecture."""
    tokenizers_dir: str = "../shared/tokenizers"
    """Folder of the real tokenizers the architecture presets name (one subfolder each)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel: PyTorch SDPA (flash/memory-efficient kernels on CUDA; loaded as ``sdpa_grouped``,
    ``grpo/model/kernels.py``), eager, or flash-attn 2 (its package)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of SFT and GRPO: less memory for about a third more compute."""

    @model_validator(mode="after")
    def _one_model_source(self) -> ModelConfig:
        if self.architecture is not None and self.name_or_path is not None:
            raise ValueError(
                f"architecture ({self.architecture!r}) and name_or_path ({self.name_or_path!r}) are both "
                "set: architecture builds random weights, name_or_path loads trained ones; set one to null"
            )
        return self

    @field_validator("name_or_path")
    @classmethod
    def _loadable_offline(cls, value: str | None, info: ValidationInfo) -> str | None:
        allow = bool(info.data.get("allow_download", False))  # declared above, so validated first
        problem = None if value is None else model_source_problem(value, allow)
        if problem is not None:
            raise ValueError(problem)
        return value


# --------------------------------------------------------------------------- sft


class OptimizerConfig(Section):
    epochs: int = Field(4, ge=1)
    """Passes over the training examples."""
    batch_size: int = Field(16, ge=1)
    """Conversations per optimizer step."""
    lr: float = Field(2e-3, gt=0.0)
    """Peak AdamW learning rate (linear warmup, then linear decay)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Share of the optimizer steps spent warming the learning rate up."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    bf16: bool = False
    """bf16 autocast of the forward pass over fp32 master weights and optimizer state, on GPU and on a CPU
    with native bf16 (AVX512-BF16/AMX; elsewhere fp32, see grpo/model/precision.py). params.yaml sets it."""
    group_by_length: bool = False
    """Batch examples of similar length: each epoch's shuffled order is cut into chunks of 50 batches,
    each chunk sorted by length into batches, and the batches shuffled. Off, a batch pads to its longest
    of randomly drawn examples; measured on the default pretraining corpus (chat fairness records of ~140
    tokens among plain texts of ~50), 53 % of the padded tokens were padding, 2 % with it on."""


class SftConfig(OptimizerConfig):
    max_length: int = Field(512, ge=16)
    """Conversations longer than this (prompt + answer tokens) are an error, not silently cut."""
    lora: bool = False
    """SFT through a LoRA adapter (sizes from model.lora) merged into the weights afterwards: the SFT
    model is full weights either way. Independent of model.lora.enabled, which decides how GRPO trains."""


# --------------------------------------------------------------------------- pretrain


class PretrainConfig(OptimizerConfig):
    records: int = Field(0, ge=0)
    """Generated training-split records the embedded model learns, loss on every token, in the ``base``
    stage (``grpo/train/pretrain.py``); 0 leaves it with random weights. Other models ignore it."""
    epochs: int = Field(1, ge=1)
    """Passes over the pretraining records."""
    every_question: bool = False
    """Each record's text asks every question its context answers (four per grounded entity, both
    polarities of a fairness scene), not only its own. Measured (README): the same in-distribution reading
    from half the steps, and on the 3.2M model fairness read on training scenes; on the 1.0M default it
    made SFT abstain more on eval (it teaches mostly abstentions), so params.yaml leaves it off."""
    fairness_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of fairness records among ``records``; None: ``data.fairness_fraction``. Measured (README):
    0.3 on the default, whose fairness records (chat-rendered) read after less pretraining than the
    grounded ones; 0.5 left SFT's grounded exact match at 0.30, 0.3 raised it to 0.40 (seed 1234)."""
    chat_tasks: list[Literal["fairness", "hallucination"]] = Field(default_factory=list)
    """Tasks whose pretraining records are the chat conversation SFT and GRPO render (system turn, user
    turn with its instruction, the answer; loss on every token) instead of the plain text. The 1M model
    reads only in the layout it was pretrained in; measured (README): with ``[fairness]`` SFT reads
    ambiguity in the chat prompt, which it never did from plain-text pretraining. A chat-rendered
    record asks only its own question (``every_question`` applies to the plain texts)."""
    copy_texts: int = Field(0, ge=0)
    """Copy texts (``grpo/train/copying.py``: ``<bos> s s``, ``s`` 10–60 random tokens, the loss on the
    second copy) drawn anew for every epoch and shuffled in with the records; 0: none. Only copying by
    content (an induction head) predicts them, the skill reading a year or a held-out name from the
    context takes, and being fresh they cannot be learned by heart. Measured (README): with
    ``copy_warmup_steps`` the base keeps the head through pretraining and SFT reads years; it costs
    time, and fairness reads no better, so params.yaml leaves both at 0."""
    copy_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps on fresh copy texts alone before the records, at ``copy_warmup_lr`` with no
    gradient clipping; 0: none. Measured (``benchmarks/copying.py``): at the base settings (lr 3e-3,
    clipped at 1.0, or unclipped) the head does not form in 1500 steps; at 1e-3 unclipped it forms
    between steps 1000 and 1200."""
    copy_warmup_lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate of the copy warm-up (linear warmup over 2 % of it, then linear decay)."""


# --------------------------------------------------------------------------- grpo


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; log-probs and entropy use the same scaled distribution (I10)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
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
                "must be > 0: it divides the logits; use a small value such as 0.1 for "
                "near-greedy sampling"
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
    """One graph per task's rows (the default and the faster: each task's backward covers only its own
    rows); false: one graph over all rows and each task's gradient through it, a full-batch backward each."""
    task_stats: bool = False
    """``sum`` mode: also take each task's gradient (grad_norm/<task>, grad_cos) at one backward per
    task; off, sum mode takes one backward of the summed loss. The other modes always need them."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: ``hf``, the trainer's own model (``model/decode.py``: Hugging Face ``generate``'s
    tokens), or vLLM colocated on the same GPU."""
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


class GrpoConfig(Section):
    group_size: int = 4
    """Completions sampled per prompt (G)."""
    steps: int = Field(40, ge=1)
    """Optimizer steps of GRPO."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step (each gets group_size completions), split across processes."""
    fairness_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of fairness prompts in every batch (the rest is hallucination)."""
    lr: float = Field(2e-3, gt=0.0)
    """AdamW learning rate of the LoRA adapter (constant after warmup)."""
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
    bf16 (AVX512-BF16/AMX; elsewhere fp32); log-probs, entropy, losses and KL in fp32. params.yaml sets it."""
    shared_prefix: bool = True
    """Score each distinct prompt once and its G completions against its key/value cache (the same
    log-probs, entropy and gradients as a forward over every row, without recomputing the prompt)."""
    reuse_prefill: bool = True
    """With shared_prefix: the update's policy pass reuses the rollout's prefill of the prompts (kept with
    its graph) instead of running them again, where that is the same computation (``step.reuses_prefill``)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout engine (hf or vllm) and the correction of its sampling/training mismatch."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Policy loss."""
    multitask: MultitaskConfig = Field(default_factory=MultitaskConfig)
    """Combination of per-task gradients."""

    @field_validator("group_size")
    @classmethod
    def _group_of_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "must be >= 2: GRPO needs at least two completions per prompt to compute an advantage"
            )
        return value


# --------------------------------------------------------------------------- rewards, tracking, monitor, checkpoint


class RewardWeights(Section):
    fairness: float = 1.0
    """Multiplier of the fairness reward (grpo.rewards.fairness)."""
    hallucination: float = 1.0
    """Multiplier of the hallucination reward (grpo.rewards.hallucination)."""


class RewardsConfig(Section):
    weights: RewardWeights = Field(default_factory=RewardWeights)
    """Per-task reward multipliers."""


class TrackingConfig(Section):
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; the environment's WANDB_MODE wins when it is stricter (disabled < offline < online)."""
    project: str = "grpo-dual"
    """W&B project name (the run name is ``experiment``)."""


class RuleConfig(Section):
    threshold: float
    """The value at which the rule fires (its direction is given in the rule's description)."""
    window: int = Field(1, ge=1)
    """Consecutive steps the condition must hold before the rule fires."""
    action: Literal["warn", "stop", "off"] = "stop"
    """warn: log and go on; stop: raise TrainingStopped with a diagnosis; off: never check."""


def _rule(threshold: float, window: int = 1, action: str = "stop") -> Any:
    return Field(default_factory=lambda: RuleConfig(threshold=threshold, window=window, action=action))


class MonitorConfig(Section):
    boundary_steps: int = Field(3, ge=0)
    """Steps (counted from the first) whose completions are checked for a broken chat boundary."""
    boundary_header: RuleConfig = _rule(0.25)
    """Boundary: fires when the share of completions holding a chat-header token exceeds threshold (a template bug puts one in nearly every completion; a small model sampling at T=1 emits a stray one now and then)."""
    boundary_end_of_turn: RuleConfig = _rule(1.0)
    """Boundary: fires when a completion holds more end-of-turn tokens than threshold."""
    boundary_prompt_echo: RuleConfig = _rule(20.0)
    """Boundary: fires when a completion begins with the first threshold characters of its user message."""
    boundary_empty: RuleConfig = _rule(1.0)
    """Boundary: fires when the mean content length (tokens, the stop token not counted) is below threshold."""
    boundary_clipped: RuleConfig = _rule(0.95, action="warn")
    """Boundary: fires when completions/clipped_ratio exceeds threshold (the model never stops)."""
    boundary_entropy_low: RuleConfig = _rule(0.01)
    """Boundary: fires when entropy is below threshold on the first steps (nothing left to explore)."""
    boundary_entropy_high: RuleConfig = _rule(6.0, action="warn")
    """Boundary: fires when entropy exceeds threshold on the first steps (near-uniform: template mismatch)."""
    entropy_floor: RuleConfig = _rule(0.01, window=5)
    """Collapse: fires when entropy stays below threshold for window steps."""
    reward_zero_std: RuleConfig = _rule(0.9, window=5)
    """Collapse: fires when frac_reward_zero_std stays >= threshold for window steps (no advantage)."""
    lengths_frozen: RuleConfig = _rule(0.0, window=10, action="warn")
    """Collapse: fires when max_length - min_length <= threshold and mean_length is unchanged for window steps."""
    step_time: RuleConfig = _rule(0.005, window=3, action="warn")
    """Collapse: fires when step_time (seconds) stays below threshold for window steps."""
    max_prob: RuleConfig = _rule(0.99, window=5, action="warn")
    """Collapse: fires when logits/max_prob stays >= threshold for window steps."""
    zero_grad: RuleConfig = _rule(0.0, window=3)
    """Collapse: fires when |loss| and every grad norm stay <= threshold for window steps."""


class CheckpointConfig(Section):
    every: int = Field(5, ge=1)
    """Optimizer steps between checkpoints."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones and stale temporary directories are deleted."""
    resume: bool = True
    """Continue from the newest complete checkpoint of the run when one exists."""


# --------------------------------------------------------------------------- eval, diagnose


class DiagnoseConfig(Section):
    prompts: int = Field(8, ge=1)
    """Eval prompts ``grpo diagnose`` samples (each gets grpo.group_size completions)."""
    entropy_floor: float = Field(0.05, ge=0.0)
    """Collapse: fail when the policy's mean token entropy (nats) is below this."""
    entropy_ratio_warn: float = Field(0.5, ge=0.0)
    """Collapse: warn when policy entropy / reference (adapter off) entropy is below this."""
    entropy_ratio_fail: float = Field(0.2, ge=0.0)
    """Collapse: fail when policy entropy / reference (adapter off) entropy is below this."""
    zero_std_warn: float = Field(0.5, ge=0.0, le=1.0)
    """Reward degeneracy: warn when the share of zero-variance groups reaches this."""
    zero_std_fail: float = Field(0.95, ge=0.0, le=1.0)
    """Reward degeneracy: fail when the share of zero-variance groups reaches this."""
    kl_init_tol: float = Field(1e-5, ge=0.0)
    """KL at init: a fresh adapter must give a per-token KL to the reference at most this."""
    kl_warn: float = Field(1.0, ge=0.0)
    """KL: warn when a trained adapter's mean per-token k3 KL to the reference exceeds this."""
    temperatures: list[float] = Field(default_factory=lambda: [0.7, 1.0, 1.3])
    """Temperatures at which entropy is measured; it must increase with them."""
    entropy_step_size: float = Field(1e-2, gt=0.0)
    """Norm of the one SGD step on the entropy term (lr = this / gradient norm)."""
    entropy_step_coef: float = Field(0.01, gt=0.0)
    """Positive entropy coefficient of the probe step (``loss = -coef * entropy``)."""
    grad_norm_warn: float = Field(1e-6, ge=0.0)
    """LoRA gradients: warn when the GRPO loss's gradient norm on the adapter is below this (vanishing)."""


class EvalConfig(Section):
    max_examples: int | None = Field(None, ge=1)
    """Evaluate at most this many eval records (file order); null evaluates all."""
    samples_per_prompt: int = Field(4, ge=0)
    """Sampled completions per prompt for diversity and entropy (self-BLEU needs at least two); 0
    decodes greedily only (a quicker evaluation, e.g. of a large eval split)."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generate() call."""
    bootstrap: int = Field(1000, ge=100)
    """Paired bootstrap resamples over eval items for the GRPO − SFT intervals of ``reports/eval.md``."""

    @field_validator("samples_per_prompt")
    @classmethod
    def _none_or_a_group(cls, value: int) -> int:
        if value == 1:
            raise ValueError(
                "is 1, but one sample per prompt has no within-prompt diversity (self-BLEU) to measure: "
                "use 0 to decode greedily only, or 2 or more"
            )
        return value
    diagnose: DiagnoseConfig = Field(default_factory=DiagnoseConfig)
    """Thresholds and settings of ``grpo diagnose``."""


# --------------------------------------------------------------------------- schedule


class ScheduleConfig(Section):
    cron: str = "0 2 * * *"
    """Cron expression of the nightly ``full-retrain`` run (read in ``timezone``)."""
    timezone: str = "UTC"
    """IANA time zone the cron expression is read in, e.g. ``Europe/Paris``."""

    @field_validator("timezone")
    @classmethod
    def _known_time_zone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError("is not an IANA time zone: give one such as UTC or Europe/Paris") from None
        return value
    deployment: str = "full-retrain"
    """Deployment name: ``prefect deployment run full-retrain/<deployment>`` triggers a run."""
    force: bool = False
    """Scheduled runs pass ``force``: rerun every stage even when DVC finds nothing stale."""


# --------------------------------------------------------------------------- root


class Config(Section):
    seed: int = 1234
    """Seed of every random generator of a run."""
    experiment: str = "default"
    """Run name: used for W&B and ``entropy_history_<experiment>.json``."""
    paths: PathsConfig = Field(default_factory=PathsConfig)
    """Where stages read and write."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Dataset generation and loading."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Base model and tokenizer."""
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    """Causal-LM pretraining of the embedded model in the ``base`` stage."""
    sft: SftConfig = Field(default_factory=SftConfig)
    """Supervised fine-tuning."""
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    """GRPO training."""
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    """Reward weights per task."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking (W&B)."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Health rules over the per-step metrics: threshold, window and action of each."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Atomic checkpoints of a GRPO run."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation of base, SFT and GRPO models, and ``grpo diagnose`` thresholds."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Nightly Prefect deployment of the full-retrain flow (read by ``flows/serve.py`` only)."""


# --------------------------------------------------------------------------- loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"grpo.loss.beta=0.1"`` -> ``("grpo.loss.beta", 0.1)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set grpo.loss.beta=0.1")
    return key.strip(), yaml.safe_load(raw)


def _describe(error: dict[str, Any], source: str) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{source}: unknown key {key} (got {error['input']!r}): remove it or fix its spelling"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    return f"{source}: {key} {message} (got {value!r}); fix it in {source} or with --set {key}=..."


def config_from_dict(tree: dict[str, Any], source: str = "params.yaml") -> Config:
    """Validate a raw tree; every problem is reported with its key, value and fix."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        lines = [_describe(err, source) for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path = DEFAULT_PARAMS, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``params.yaml`` and apply ``--set section.key=value`` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such params file; run from the project root or pass --params PATH")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    source = f"{path}" + (" (with --set overrides)" if overrides else "")
    return config_from_dict(tree, source)


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain dict of the whole tree (for hashing, W&B and reports)."""
    return config.model_dump(mode="json")
