"""``eval``: the evaluation stage and ``grpo diagnose`` (``grpo/eval/``, ``grpo/checks/diagnose.py``);
``preflight``: the bounds of the gate's behaviour checks (``grpo/checks/behaviour.py``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from grpo.config.base import Section


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


class PreflightConfig(Section):
    min_ended_share: float = Field(0.5, ge=0.0, le=1.0)
    """``sft_ends_answers``: the share of eval prompts whose greedy SFT answer must end with a stop token
    within ``grpo.sampling.max_new_tokens``. An SFT model that does not stop gives GRPO truncated,
    unrewardable completions; 0 turns the check into a report (a model trained too briefly to answer)."""


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
    diagnose: DiagnoseConfig = Field(default_factory=DiagnoseConfig)
    """Thresholds and settings of ``grpo diagnose``."""

    @field_validator("samples_per_prompt")
    @classmethod
    def _none_or_a_group(cls, value: int) -> int:
        if value == 1:
            raise ValueError(
                "is 1, but one sample per prompt has no within-prompt diversity (self-BLEU) to measure: "
                "use 0 to decode greedily only, or 2 or more"
            )
        return value
