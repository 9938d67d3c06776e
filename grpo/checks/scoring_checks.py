"""The pre-flight checks of scoring, the loss and the update (invariants I7-I10, I12), each driving the
step's own function.

The policy is perturbed away from the SFT weights (LoRA B != 0, or noise on every trainable weight)
before the ratio/KL/reference checks, so none can pass because policy and reference coincide; the
temperature is not 1, so a scorer that forgot it differs; the rewards' fp32 group mean is inexact, so
a zero-variance test by ``std == 0`` misses groups. The token-boundary checks (I1-I6, I11) are in
``invariants.py``, which lists every check of this kind (``FUNCTION_CHECKS``).
"""

from __future__ import annotations

import dataclasses

import torch

from grpo.checks.gated import Gated, perturbed_policy, restored, step_batch, with_grpo
from grpo.checks.probes import ENTROPY_TOL, Check, bounded, reference_kl
from grpo.core.advantages import group_advantages
from grpo.core.logprobs import completion_logits
from grpo.core.losses import clipped_surrogate, k3_kl, masked_mean
from grpo.model.rollout import sampling_processors
from grpo.model.scoring import score_inputs
from grpo.train.step_types import ScoredBatch, Step
from grpo.train.update import global_totals, gradient, part_rows, parts, score_parts

PER_TOKEN_LEAK = 1e-6
"""How far a one-token change of 0.1 nats may move any other token's ratio or KL (I8): fp32's rounding; a
ratio or KL of a sequence or batch mean moves them by the change's share of the row or batch, orders beyond."""
OWN_RATIO_ERROR = 1e-5
"""How far the changed token's own ratio may be from exp(0.1) (I8): fp32's rounding of exp."""


def _fresh_gap(s: Gated, model: torch.nn.Module, batch: ScoredBatch) -> float:
    """Max |the step's reference log-probs - ``model``'s| over the completion tokens, ``model`` scored part by
    part as the step scores its reference (the same forwards: in any precision the SFT weights agree
    exactly, where a model that is not them differs by far more)."""
    model.to(batch.inputs.input_ids.device).eval()
    other = score_parts(s.step, batch.inputs, batch.rows, adapter=True, model=model)
    return float((batch.ref_logprobs - other).abs()[batch.completion_mask].max())


def _per_token_leak(old: torch.Tensor) -> tuple[float, float]:
    """Shift one token's log-prob by 0.1 (every position counted): ``(largest change of any OTHER
    token's ratio or KL, error of that token's ratio)``. A sequence-level ratio or KL spreads the
    shift over the whole row (I8)."""
    mask = torch.ones_like(old, dtype=torch.bool)
    new = old.clone()
    new[0, -1] += 0.1
    tokens = clipped_surrogate(new, old, torch.ones(len(old), device=old.device), mask, 0.2, 0.2)
    kl = k3_kl(new, old, mask)
    others = mask.clone()
    others[0, -1] = False
    leak = max(float((tokens.ratio - 1).abs()[others].max()), float(kl.abs()[others].max()))
    return leak, abs(float(tokens.ratio[0, -1]) - float(torch.exp(torch.tensor(0.1))))


def check_ratio_kl_reference(s: Gated) -> Check:
    """I8, I9 with a perturbed policy (at the SFT weights these would hold whatever the code did): the step's
    reference log-probs equal a fresh load of the SFT weights (to float reassociation: the shared-prefix
    forward caches the prompt, so two scorings may differ in the last bits) and differ from the base's,
    the policy's KL to them is > 0, and the ratio and KL are per token."""
    numbers = _ratio_kl_numbers(s)
    same = s.tolerance() / 10  # 1e-5 in fp32; SFT and base log-probs differ by far more
    base_gap, leak = numbers["ref_vs_base"], numbers["other_tokens_ratio_kl_change"]
    failures = [
        name
        for name, bad in (
            ("the reference is not the SFT weights (I9)", not numbers["ref_vs_fresh_sft"] <= same),  # NaN too
            ("the reference equals the pre-SFT base (I9)", base_gap is not None and not base_gap > same),
            ("KL to the reference is 0 with a perturbed policy (I9)", not numbers["kl_perturbed"] > 0.0),
            ("a one-token change moved other tokens' ratio or KL (I8)", not leak <= PER_TOKEN_LEAK),  # NaN too
            ("the changed token's ratio is not exp(0.1) (I8)", not numbers["own_ratio_error"] <= OWN_RATIO_ERROR),
        )
        if bad
    ]
    detail = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
    bound = {
        "ref_vs_fresh_sft": same,
        "ref_vs_base": f"> {same:g}",
        "kl_perturbed": "> 0",
        "other_tokens_ratio_kl_change": PER_TOKEN_LEAK,
        "own_ratio_error": OWN_RATIO_ERROR,
    }
    return Check(
        "ratio_kl_reference",
        "fail" if failures else "pass",
        numbers,
        detail + ("; " + "; ".join(failures) if failures else ""),
        "the reference is the SFT policy (LoRA: the adapter disabled; full fine-tuning: a frozen copy of "
        "the SFT model); ratio and KL per token"
        if failures
        else "",
        "I8, I9",
        bound,
    )


def _ratio_kl_numbers(s: Gated) -> dict[str, float | None]:
    """What ``check_ratio_kl_reference`` judges: the step's reference log-probs against a fresh load of the
    SFT weights and of the base (None without one), the perturbed policy's KL to its reference, and how
    far a one-token change moves the other tokens' ratio and KL, and its own ratio from exp(0.1)."""
    with perturbed_policy(s.policy, s.cfg.seed):
        batch, _ = step_batch(
            s, s.cfg.seed + 1, num_iterations=2, loss={"beta": max(s.cfg.grpo.loss.beta, 0.04)}
        )
        kl = reference_kl(s.policy, batch.inputs, s.reference)
    sft_gap = _fresh_gap(s, s.sft, batch)
    base_gap = _fresh_gap(s, s.base, batch) if s.base is not None else None
    leak, own = _per_token_leak(batch.old_logprobs)
    return {
        "ref_vs_fresh_sft": sft_gap,
        "ref_vs_base": base_gap,
        "kl_perturbed": kl,
        "other_tokens_ratio_kl_change": leak,
        "own_ratio_error": own,
    }


def _formula(step: Step, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The policy's log-probs and entropy part by part as the step scores them (``update.part_rows``), and
    ``softmax(z / T)``'s written out in float64 on the raw logits of those very forwards
    (``logprobs.completion_logits``, the scorer's own forward, run again on the same rows): [N, C] each.
    The same forwards, so the gap measures the formula (the temperature, the log-softmax, the entropy),
    whatever the precision. Last, the rounding of the same formula in fp32 (torch's own ``log_softmax``
    on those logits against float64, the largest over the completion tokens): a log-softmax and an entropy
    summed over a whole vocabulary in fp32 round by more than a log-prob's tolerance on some CPUs' vector
    paths (1.4e-4 nats of entropy on a 152k vocabulary at T = 0.5 on an AVX2 CPU)."""
    inputs, width = batch.inputs, batch.completion_mask.shape[1]
    shape = batch.completion_mask.shape
    scored_logp, scored_entropy = torch.zeros(shape), torch.zeros(shape)
    logp, entropy = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    mask, rounding = batch.completion_mask.cpu(), 0.0
    for subset, micro in parts(step):
        found = part_rows(step, batch.rows, subset, micro)
        if not found:
            continue
        idx = torch.cat([part for part, _ in found.values()])
        segments = [task for task, (part, _) in found.items() for _ in range(len(part))]
        rows = inputs.rows(idx)
        with torch.no_grad(), step.autocast():
            scored = score_inputs(step.model, rows, shared_prefix=step.shares_prefix, segments=segments)
            raw = completion_logits(
                step.model,
                rows.input_ids,
                rows.attention_mask,
                width,
                shared_prefix=step.shares_prefix,
                segments=segments,
            )  # [n, C, V]
        written = torch.log_softmax(raw.double() / inputs.temperature, dim=-1)
        ids = rows.input_ids[:, -width:].unsqueeze(-1)
        logp[idx.cpu()] = written.gather(-1, ids).squeeze(-1).cpu()
        entropy[idx.cpu()] = -(written.exp() * written).sum(-1).cpu()
        kept = mask[idx.cpu()]
        if kept.any():  # the same formula in fp32, against float64
            single = torch.log_softmax(raw.float() / inputs.temperature, dim=-1)
            single_logp = single.gather(-1, ids).squeeze(-1).double().cpu()
            single_entropy = (-(single.exp() * single).sum(-1)).double().cpu()
            rounding = max(
                rounding,
                float((single_logp - logp[idx.cpu()]).abs()[kept].max()),
                float((single_entropy - entropy[idx.cpu()]).abs()[kept].max()),
            )
        scored_logp[idx.cpu()], scored_entropy[idx.cpu()] = (
            scored.logprobs.float().cpu(),
            scored.entropy.float().cpu(),
        )
    return logp, entropy, torch.stack([scored_logp, scored_entropy]), rounding


def check_temperature(s: Gated) -> Check:
    """I10 at the configured temperature and at one != 1 (a missing division shows): the rollout
    records the temperature it sampled at, and the step's stored log-probs and the scorer's entropy
    are those of ``softmax(z / T)`` (perturbed policy, so it is not the SFT model)."""
    temperatures = sorted(
        {s.cfg.grpo.sampling.temperature, 0.5 if s.cfg.grpo.sampling.temperature == 1 else 1.0}
    )
    gaps, wrong_record, rounding = {}, [], 0.0
    with perturbed_policy(s.policy, s.cfg.seed):
        for t in temperatures:
            batch, sampled = step_batch(s, s.cfg.seed + 2, num_iterations=2, sampling={"temperature": t})
            if sampled.rollout.temperature != t or batch.inputs.temperature != t:
                wrong_record.append(t)
            logp, manual_entropy, (scored_logp, entropy), fp32 = _formula(
                with_grpo(s.step, num_iterations=2, sampling={"temperature": t}), batch
            )
            rounding = max(rounding, fp32)
            mask = batch.completion_mask.cpu()
            gaps[f"T={t}"] = max(
                float((batch.old_logprobs.cpu().double() - logp).abs()[mask].max()),
                float((scored_logp.double() - logp).abs()[mask].max()),
                float((entropy.double() - manual_entropy).abs()[mask].max()),
            )
    worst = max(gaps.values())
    # The tolerance, or twice what the same formula rounds by in fp32 on these logits where that is more: a
    # missing division by T moves log-probs and entropy by the logits' scale, orders of magnitude beyond.
    bound = max(s.tolerance(), 2 * rounding)
    detail = (
        f"max |scored - written out| of the stored and fresh log-probs and the entropy, on the raw logits of "
        f"the step's own forwards: {gaps} (fp32's own rounding of the formula there: {rounding:.3g})"
    )
    check = bounded(
        "temperature",
        "I10",
        worst,
        bound,
        detail,
        "divide the logits by the rollout's temperature before log-softmax AND entropy",
        "nats",
    )
    if wrong_record:
        return Check(
            check.name,
            "fail",
            worst,
            detail + f"; the rollout did not record T={wrong_record}",
            "the rollout must record the temperature it sampled at",
            check.invariant,
            check.bound,
            check.unit,
        )
    return check


def check_entropy_sign(s: Gated) -> Check:
    """I7: the direction the trainer's update (``update.gradient``) takes on the entropy bonus alone (zero
    advantages, no KL), combined in the configured mode (``reward_only``, ``low_memory``, ``sum``'s one
    backward included), raises entropy when followed one small step."""
    step = s.variant(loss={"beta": 0.0, "entropy_coef": 1.0})
    batch, _ = step_batch(s, s.cfg.seed + 3, loss={"beta": 0.0, "entropy_coef": 1.0})
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages), prefills=())
    with torch.no_grad(), step.autocast():
        before = float(masked_mean(score_inputs(step.model, batch.inputs).entropy, batch.completion_mask))
    direction = gradient(step, batch, global_totals(step, batch)).direction
    norm = float(direction.norm())
    with restored(step):
        with torch.no_grad():
            offset = 0
            for p in step.params:  # an SGD step of norm 0.05 against the direction
                p -= 0.05 / max(norm, 1e-12) * direction[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
            with step.autocast():
                after = float(
                    masked_mean(score_inputs(step.model, batch.inputs).entropy, batch.completion_mask)
                )
    mt = s.cfg.grpo.multitask
    detail = (
        f"entropy {before:.6f} -> {after:.6f} after one step along the trainer's update in mode {mt.mode} "
        f"(reward_only={mt.reward_only}, low_memory={mt.low_memory}, task_stats={mt.task_stats}), "
        f"gradient norm {norm:.3g}"
    )
    status = "pass" if after - before > ENTROPY_TOL else "fail"
    return Check(
        "entropy_sign",
        status,
        after - before,
        detail,
        "" if status == "pass" else "a positive entropy_coef must raise entropy: its sign is flipped (I7)",
        "I7",
        f"> {ENTROPY_TOL}",
        "nats",
    )


OVERFLOWING = 0.75 * torch.finfo(torch.float32).max
"""A reward whose fp32 sum over two or more equal copies overflows: their mean is inf, a computed std inf or NaN."""


def inexact_value(group: int) -> float | None:
    """A reward whose fp32 mean over ``group`` equal copies differs from itself (float noise to mask), found by
    trying each value on this machine's kernels; None where none differs (one or two copies always, other
    sizes on some CPUs' summation orders)."""
    for value in (0.1, 0.2, 0.7, *(k / 100 for k in range(1, 100))):
        same = torch.full((1, group), value)
        if bool((same - same.mean(-1, keepdim=True)).any()):
            return value
    return None


def _equal_reward_batches(group: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Reward batches whose first group has equal rewards a ``std == 0`` test misses -> ``{name: (rewards,
    group size)}``; after it, where there is one, a mixed group that keeps its signal.

    A computed std of equal rewards is 0 in some layouts and not in others (on a CPU, a batch of one group
    takes a kernel whose std of three 0.9s is 7e-8, a batch of several groups one whose std is 0), so each
    inexact value goes alone and beside a mixed group, and an overflowing one alone."""
    batches = {}
    for g in dict.fromkeys((group, 3)):
        value = inexact_value(g)
        if value is not None:
            mixed = torch.tensor([(0.1, 0.2, 0.7)[i % 3] for i in range(g)])
            batches[f"G={g} x {value} alone"] = torch.full((g,), value), g
            batches[f"G={g} x {value} beside a mixed group"] = torch.cat([torch.full((g,), value), mixed]), g
    if group > 1:
        batches[f"G={group} x {OVERFLOWING:.3g} alone"] = torch.full((group,), OVERFLOWING), group
    return batches


def check_zero_variance_groups(s: Gated) -> Check:
    """I12: ``group_advantages`` with the configured scaling gives exactly 0 to groups of equal rewards whose
    fp32 mean is inexact (0.1/0.2/0.7-like) or overflows, alone in the batch and beside a mixed group, and
    counts them; a mixed group keeps its signal."""
    group, scale = s.cfg.grpo.group_size, s.cfg.grpo.loss.scale_rewards
    worst, wrong = 0.0, []
    batches = _equal_reward_batches(group)
    for name, (rewards, g) in batches.items():
        advantages, stats = group_advantages(rewards, g, scale)
        worst = max(worst, float(advantages[:g].abs().nan_to_num(nan=float("inf")).max()))
        rest = advantages[g:]
        if stats["frac_reward_zero_std"] != g / len(rewards):
            wrong.append(f"{name}: frac_reward_zero_std {stats['frac_reward_zero_std']}")
        if len(rest) and not (bool(rest.abs().max() > 0) and bool(torch.isfinite(rest).all())):
            wrong.append(f"{name}: the mixed group lost its signal")
    detail = f"max |advantage| of equal-reward groups over {len(batches)} batches ({', '.join(batches)}; scale {scale})"
    check = bounded("zero_variance_groups", "I12", worst, 0.0, detail,
                    "mask equal-reward groups to advantage exactly 0, found by equality of the rewards, never by a "
                    "computed std; never divide float noise by a tiny epsilon")
    if wrong:
        return Check(check.name, "fail", worst, detail + "; " + "; ".join(wrong),
                     check.hint or "count equal-reward groups in frac_reward_zero_std", check.invariant, check.bound)
    return check


def check_sampling_processors(s: Gated) -> Check:
    """I10 in part: what else shapes sampling but not the scored distribution (a warning, not a stop)."""
    active = sampling_processors(s.cfg.grpo.sampling)
    if not active:
        return Check(
            "sampling_processors",
            "pass",
            [],
            "sampling is plain softmax(z / T): what is scored",
            "",
            "I10",
            [],
        )
    return Check(
        "sampling_processors",
        "warn",
        list(active),
        f"{', '.join(active)} change the sampling distribution but not the scored one: the ratio and KL "
        "describe softmax(z / T) while the tokens came from the processed distribution",
        "set top_p: 1.0, top_k: 0, min_new_tokens: 0 and the penalties to 0 for exact I10",
        "I10",
        [],
    )
