"""The diagnosis's checks on numbers already measured: the target's lineage, the entropy against its
reference's, the share of degenerate reward groups, the advantages.

Each takes the figures (``grpo/checks/diagnose.py`` measures them on the probe) and says ``pass``, ``warn``,
``fail`` or ``skip``, its number, and what to try; none of them runs the model.
"""

from __future__ import annotations

import torch

from grpo.checks.diagnosis_target import Target
from grpo.checks.probes import Check, Status
from grpo.config import Config


def check_target_lineage(target: Target) -> Check:
    """Whether the target (and the SFT weights under an adapter) match the current code and params."""
    if target.kind == "model" and not target.stale and not (target.path / "lineage.json").is_file():
        return Check(
            "lineage", "skip", None, f"{target.path} carries no lineage (no stage of the pipeline built it)"
        )
    if target.stale:
        return Check(
            "lineage",
            "warn",
            len(target.stale),
            "; ".join(target.stale),
            "the numbers describe older code or params: rebuild with `dvc repro` before trusting them",
        )
    return Check("lineage", "pass", 0, "built by the current code, params and inputs")


def check_collapse(cfg: Config, policy: float, reference: float, temperature: float) -> Check:
    """Policy entropy against an absolute floor and against the reference's (I9)."""
    d = cfg.eval.diagnose
    ratio = policy / reference if reference > 0 else 1.0
    detail = (
        f"policy {policy:.4f} nats/token vs reference {reference:.4f}, ratio {ratio:.3f}, at T={temperature}"
    )
    hint = (
        "entropy collapse: raise grpo.loss.entropy_coef (> 0) or grpo.loss.beta, lower grpo.lr, or go back "
        "to an earlier checkpoint (`grpo plot-entropy` shows when it fell)"
    )
    if policy < d.entropy_floor or ratio < d.entropy_ratio_fail:
        return Check("entropy_collapse", "fail", policy, detail, hint)
    if ratio < d.entropy_ratio_warn:
        return Check("entropy_collapse", "warn", policy, detail, hint)
    return Check("entropy_collapse", "pass", policy, detail)


def check_reward_degeneracy(cfg: Config, stats: dict[str, float], n_groups: int) -> Check:
    """Share of groups whose G rewards are all equal: they give advantage 0, no learning signal (I12)."""
    d, share = cfg.eval.diagnose, stats["frac_reward_zero_std"]
    detail = (
        f"{round(share * n_groups)} of {n_groups} groups have zero reward std "
        f"(G={cfg.grpo.group_size}, mean reward {stats['reward']:.3f})"
    )
    hint = (
        "no learning signal: check the answers parse (all rewards -1 = unparseable), raise grpo.group_size or "
        "the temperature, or set grpo.dynamic_sampling: filter | resample"
    )
    status: Status = "fail" if share >= d.zero_std_fail else "warn" if share >= d.zero_std_warn else "pass"
    return Check("reward_degeneracy", status, share, detail, hint if status != "pass" else "")


def check_advantages(advantages: torch.Tensor) -> Check:
    """Advantages are finite and not all zero. advantages: [N]."""
    if not torch.isfinite(advantages).all():
        return Check(
            "advantages",
            "fail",
            None,
            "advantages hold NaN/Inf",
            "a reward returned NaN/Inf, or the std division lost its epsilon: check grpo/core/advantages.py",
        )
    abs_mean = float(advantages.abs().mean())
    if abs_mean == 0.0:
        return Check(
            "advantages",
            "fail",
            0.0,
            "every advantage is exactly 0: the policy term has no gradient",
            "see reward_degeneracy: every group's rewards are equal",
        )
    return Check("advantages", "pass", abs_mean, f"finite, mean |A| {abs_mean:.3f}")
