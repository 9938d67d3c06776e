"""``grpo diagnose <model-or-checkpoint>``: the deep entropy diagnosis of one policy.

The target (``grpo/checks/diagnosis_target.py``) is a full model folder (``models/base``, ``models/sft``: the
policy GRPO would start from), a GRPO adapter folder (``models/grpo``), the fully trained weights in
``models/grpo`` (``model.lora.enabled: false``) or a GRPO checkpoint (``runs/<experiment>/checkpoint-XXXXXXXX``:
the policy is rebuilt on the SFT weights and the checkpoint's trainable weights loaded). The reference
is the same model with the adapter disabled, or under full fine-tuning the frozen SFT weights (I9).
A few eval prompts get ``grpo.group_size`` sampled completions each (the probe) and every check reads
those token ids; each says ``pass``, ``warn`` or ``fail``, its number, and what to try. ``skip`` marks
a check that does not apply. The gradient check covers the LoRA weights (``lora_gradients``) or, under
full fine-tuning, every weight (``gradients``).

Diagnosis only reads: it reports a stale lineage instead of refusing (an old collapsed checkpoint
is exactly what one wants to diagnose after a fix), and it never writes a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo.checks.diagnosis_checks import (
    check_advantages,
    check_collapse,
    check_reward_degeneracy,
    check_target_lineage,
)
from grpo.checks.diagnosis_target import Target, load_target
from grpo.checks.probes import (
    ENTROPY_TOL,
    Check,
    entropy_step,
    mean_entropy,
    reference_entropy,
    reference_kl,
)
from grpo.config import Config
from grpo.core.advantages import group_advantages, per_row
from grpo.core.losses import policy_loss_terms, total_loss
from grpo.data.prompts import render_records
from grpo.data.select import balanced_records, eval_records
from grpo.files import write_json
from grpo.model.fast import FastPaths
from grpo.model.rollout import Rollout, generate_rollout, stop_ids
from grpo.model.scoring import RolloutInputs, rollout_inputs, score_inputs, score_reference
from grpo.rewards import group_rewards


@dataclass(frozen=True)
class Probe:
    """Sampled completions of a few eval prompts, joined as the ids every check scores."""

    records: list[dict]  # [n_prompts]
    rollout: Rollout  # N = n_prompts * G rows
    inputs: RolloutInputs  # [N, P + C] ids and masks on the model's device, the rollout's temperature

    @property
    def input_ids(self) -> torch.Tensor:  # [N, P + C]
        return self.inputs.input_ids

    @property
    def completion_mask(self) -> torch.Tensor:  # [N, C] bool
        return self.inputs.completion_mask

    def rows(self) -> dict[str, torch.Tensor]:
        """Task -> row indices of the probe (row ``i`` answers ``records[i // G]``)."""
        tasks = per_row([r["task"] for r in self.records], self.rollout.group_size)
        return {t: torch.tensor([i for i, x in enumerate(tasks) if x == t]) for t in dict.fromkeys(tasks)}


# --------------------------------------------------------------------------- probe and scoring


def make_probe(cfg: Config, target: Target) -> Probe:
    """``eval.diagnose.prompts`` eval prompts x ``grpo.group_size`` completions from the policy."""
    records = balanced_records(eval_records(cfg), cfg.eval.diagnose.prompts)
    tok = target.tokenizer
    prompts = render_records(tok, records, cfg.model.chat_template_kwargs)
    eos_ids = stop_ids(target.model, tok, cfg.model.extra_stop_tokens)  # the trainer's stop ids
    rollout = generate_rollout(
        target.model, tok, prompts, cfg.grpo.group_size, cfg.grpo.sampling, eos_ids, seed=cfg.seed,
        fast=FastPaths.resolve(cfg.model.fast_paths),
    )
    return Probe(records, rollout, rollout_inputs(rollout, next(target.model.parameters()).device))


def _at(probe: Probe, temperature: float) -> RolloutInputs:
    """The probe's inputs scored at another temperature (the temperature check only)."""
    return dataclasses.replace(probe.inputs, temperature=temperature)


def probe_rewards(cfg: Config, probe: Probe) -> torch.Tensor:
    """Weighted reward of every probe completion: [N]."""
    values = group_rewards(probe.rollout.texts, probe.records, probe.rollout.group_size, cfg.rewards)
    return torch.tensor(values, dtype=torch.float32)


def _grad_norm(params: list[torch.nn.Parameter]) -> float:
    squares = [float(p.grad.float().pow(2).sum()) for p in params if p.grad is not None]
    return math.sqrt(sum(squares))


# --------------------------------------------------------------------------- checks


def check_gradients(cfg: Config, target: Target, probe: Probe, advantages: torch.Tensor) -> Check:
    """One backward of the GRPO loss reaches the trainable weights with a finite, non-zero gradient:
    the LoRA weights (``lora_gradients``), or every weight under full fine-tuning (``gradients``)."""
    model = target.model
    name, what = ("lora_gradients", "LoRA") if target.lora else ("gradients", "trainable")
    params = [p for n, p in model.named_parameters() if p.requires_grad and ("lora_" in n or not target.lora)]
    if not params:
        return Check(
            name,
            "fail",
            0.0,
            f"no {what} parameter",
            "load the adapter trainable (is_trainable=True) and check model.lora.target_modules"
            if target.lora
            else "the policy's weights must require grad under model.lora.enabled: false",
        )
    probing = not bool(advantages.any())
    # All-zero real advantages would zero the policy gradient: probe the wiring with +-1 instead.
    adv = (torch.arange(len(advantages)) % 2 * -2.0 + 1.0) if probing else advantages
    model.zero_grad(set_to_none=True)
    _probe_loss(cfg, target, probe, adv).backward()
    norm = _grad_norm(params)
    nonzero = sum(p.grad is not None and bool(p.grad.any()) for p in params)
    model.zero_grad(set_to_none=True)
    detail = f"grad norm {norm:.3g} over {len(params)} {what} tensors ({nonzero} non-zero)" + (
        " with +-1 probe advantages (real ones are all 0)" if probing else ""
    )
    if not math.isfinite(norm) or norm == 0.0:
        return Check(
            name,
            "fail",
            norm,
            detail,
            "the loss does not reach the trained weights: check requires_grad, the completion mask and "
            "the loss",
        )
    if norm < cfg.eval.diagnose.grad_norm_warn:
        return Check(
            name, "warn", norm, detail, "vanishing gradient: the softmax is saturated (see entropy_collapse)"
        )
    return Check(name, "pass", norm, detail)


def _probe_loss(cfg: Config, target: Target, probe: Probe, advantages: torch.Tensor) -> torch.Tensor:
    """The GRPO loss of the probe under ``advantages`` [N], as the step computes it (``total_loss``), with
    the reference's log-probs where ``grpo.loss.beta`` > 0."""
    model, loss_cfg = target.model, cfg.grpo.loss
    with torch.no_grad():
        ref = score_reference(model, probe.inputs, target.reference).logprobs if loss_cfg.beta > 0 else None
    scored = score_inputs(model, probe.inputs)
    terms, _ = policy_loss_terms(
        scored.logprobs,
        scored.logprobs.detach(),
        ref,
        advantages.to(scored.logprobs.device),
        probe.completion_mask,
        scored.entropy,
        epsilon_low=loss_cfg.epsilon_low,
        epsilon_high=loss_cfg.epsilon_high,
        loss_type=loss_cfg.loss_type,
        max_completion_length=cfg.grpo.sampling.max_new_tokens,
    )
    return total_loss(terms, loss_cfg.beta, loss_cfg.entropy_coef)


def check_temperature(cfg: Config, target: Target, probe: Probe) -> Check:
    """Entropy of softmax(z / T) must increase with T on the same ids (scoring honours T, I10)."""
    temps = sorted(cfg.eval.diagnose.temperatures)
    values = [mean_entropy(target.model, _at(probe, t)) for t in temps]
    detail = ", ".join(f"T={t}: {v:.4f}" for t, v in zip(temps, values, strict=True))
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    if any(step < -ENTROPY_TOL for step in steps):
        return Check(
            "temperature_entropy",
            "fail",
            values,
            detail,
            "entropy falls as T rises: scoring does not divide the logits by the temperature (I10)",
        )
    if not any(step > ENTROPY_TOL for step in steps):
        return Check(
            "temperature_entropy",
            "warn",
            values,
            detail,
            "entropy is flat in T: the distribution is saturated (one-hot logits)",
        )
    return Check("temperature_entropy", "pass", values, detail)


@torch.no_grad()
def check_kl_init(cfg: Config, target: Target, probe: Probe) -> Check:
    """k3 KL between the policy and its reference on the same ids: 0 where GRPO starts (a fresh adapter,
    or the weights against a frozen copy of themselves), reported otherwise."""
    d = cfg.eval.diagnose
    kl = reference_kl(target.model, probe.inputs, target.reference)
    detail = f"mean per-token k3 KL to the reference {kl:.3g}"
    start = "a fresh adapter" if target.lora else "the weights GRPO starts from"
    if target.fresh:
        if kl > d.kl_init_tol:
            return Check(
                "kl_init",
                "fail",
                kl,
                f"{detail} for {start}",
                "GRPO's starting policy must equal its reference (LoRA: B = 0; full fine-tuning: a frozen "
                "copy of the same weights): check the adapter init, the reference and I8/I9",
            )
        return Check("kl_init", "pass", kl, f"{detail} for {start}")
    trained = "adapter" if target.lora else "weights"
    if kl <= d.kl_init_tol:
        return Check(
            "kl_init",
            "warn",
            kl,
            f"{detail}: the trained {trained} change nothing",
            f"the {trained} never moved: look for zero gradients or a zero learning rate in training",
        )
    if kl > d.kl_warn:
        return Check(
            "kl_init", "warn", kl, detail, "the policy drifted far: raise grpo.loss.beta or lower grpo.lr"
        )
    return Check("kl_init", "pass", kl, detail)


def check_entropy_step(cfg: Config, target: Target, probe: Probe) -> Check:
    """One step on ``-coef * entropy`` alone, combined in the configured multitask mode as the GRPO
    step combines it (``probes.entropy_step``, I7), must raise entropy.

    The trainable weights are restored afterwards. The step has norm ``eval.diagnose.entropy_step_size``
    whatever the gradient's scale.
    """
    d = cfg.eval.diagnose
    before, after, norm = entropy_step(
        target.model, probe.inputs, probe.rows(), cfg.grpo.multitask, d.entropy_step_coef, d.entropy_step_size
    )
    if not math.isfinite(norm) or norm == 0.0:
        return Check(
            "entropy_step",
            "warn",
            norm,
            f"entropy gradient norm {norm}: nothing to step on",
            "the distribution is saturated (one-hot logits): see entropy_collapse",
        )
    detail = f"entropy {before:.5f} -> {after:.5f} after one step with entropy_coef={d.entropy_step_coef}"
    if abs(after - before) <= ENTROPY_TOL:
        return Check(
            "entropy_step",
            "warn",
            after - before,
            detail,
            "entropy did not move: the distribution is saturated (one-hot logits): see entropy_collapse",
        )
    if after < before:
        return Check(
            "entropy_step",
            "fail",
            after - before,
            detail,
            "minimising the entropy term lowers entropy: its sign in total_loss is flipped (I7)",
        )
    if cfg.grpo.loss.entropy_coef < 0:
        return Check(
            "entropy_step",
            "warn",
            after - before,
            detail,
            f"grpo.loss.entropy_coef={cfg.grpo.loss.entropy_coef} < 0 pushes entropy DOWN in training",
        )
    return Check("entropy_step", "pass", after - before, detail)


# --------------------------------------------------------------------------- driver and output


def diagnose(cfg: Config, path: str | Path, progress: bool = True) -> tuple[Target, list[Check]]:
    """Load the target, sample the probe, run every check in order."""
    target = load_target(cfg, path)
    probe = make_probe(cfg, target)
    rewards = probe_rewards(cfg, probe)
    advantages, stats = group_advantages(rewards, cfg.grpo.group_size, cfg.grpo.loss.scale_rewards)
    steps: list[Callable[[], Check]] = [
        lambda: check_target_lineage(target),
        lambda: check_collapse(
            cfg,
            mean_entropy(target.model, probe.inputs),
            reference_entropy(target.model, probe.inputs, target.reference),
            probe.inputs.temperature,
        ),
        lambda: check_reward_degeneracy(cfg, stats, len(probe.records)),
        lambda: check_advantages(advantages),
        lambda: check_gradients(cfg, target, probe, advantages),
        lambda: check_temperature(cfg, target, probe),
        lambda: check_kl_init(cfg, target, probe),
        lambda: check_entropy_step(cfg, target, probe),
    ]
    checks = [step() for step in tqdm(steps, desc="diagnose", disable=not progress)]
    return target, checks


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "/".join(f"{v:.3g}" for v in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def format_table(checks: list[Check]) -> str:
    """A plain-text table: check, status, value, detail; a ``try:`` line under each non-pass check."""
    rows = [("check", "status", "value", "detail")] + [
        (c.name, c.status, _value(c.value), c.detail) for c in checks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for row, check in zip(rows, [None, *checks], strict=True):
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
        if check is not None and check.hint:
            lines.append(" " * (sum(widths) + 6) + f"try: {check.hint}")
    return "\n".join(lines)


def run(cfg: Config, target: str, out: str | None = None) -> int:
    """``grpo diagnose TARGET [--out FILE]``: print the table; exit 1 when a check fails."""
    target, checks = diagnose(cfg, target)
    failed = [c.name for c in checks if c.status == "fail"]
    print(f"diagnose {target.path} ({target.kind})\n{format_table(checks)}")
    if out:
        report = {
            "target": str(target.path),
            "kind": target.kind,
            "failed": failed,
            "checks": [asdict(check) for check in checks],
        }
        write_json(Path(out), report)
    print(
        f"diagnose: {len(failed)} check(s) failed: {', '.join(failed)}"
        if failed
        else "diagnose: no check failed"
    )
    return 1 if failed else 0
