"""The pre-flight checks of invariants I1-I12, each driving a stage's own function.

The stage functions come in through ``Gated`` (``gated.py``: the trainer's step, built as it builds it):
the SFT stage's ``build_examples``, the rollout's ``rollout_from_sequences``, the step's ``draw`` and
``prepare_batch``, the scorer ``score_inputs``, the loss's ``clipped_surrogate`` and ``k3_kl``, the
update's ``gradient``, ``group_advantages``. The probes are built so no check can pass vacuously:
prompts of very different widths (a wrong cut lands in real prompt text), a stop token equal to pad in
mid-row, a policy perturbed away from the SFT weights (LoRA B != 0, or noise on every trainable weight)
before the ratio/KL/reference checks, a temperature other than 1, rewards whose fp32 group mean is
inexact.
Each check reports the number it compared (``value``) and the ``bound``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from grpo.checks.gated import Gated, pad_not_stop, perturbed_policy, restored, step_batch, with_grpo
from grpo.checks.probes import ENTROPY_TOL, Check, bounded, reference_kl
from grpo.checks.tokenizer_boundary import boundary_problems
from grpo.core.advantages import group_advantages
from grpo.core.batching import left_pad
from grpo.core.logprobs import completion_logits, score_completions
from grpo.core.losses import clipped_surrogate, k3_kl, masked_mean
from grpo.model.rollout import Rollout, rollout_from_sequences, sampling_processors
from grpo.model.sampling import EosSuppressor, build_logits_processors
from grpo.model.scoring import score_inputs
from grpo.train.causal_lm import build_examples
from grpo.train.dynamic_sampling import Draw
from grpo.train.step import ScoredBatch, Step, header_tokens, prepare_batch
from grpo.train.update import global_totals, gradient, part_rows, parts, score_parts


def check_render_parity(s: Gated) -> Check:
    """I1, I2: the SFT stage's examples (``sft.build_examples``) start with exactly the prompt ids the
    GRPO step samples from, carry no loss on them, and end their supervised ids with a stop token."""
    examples = build_examples(s.records, s.tokenizer, s.cfg.sft.max_length, s.cfg.model.chat_template_kwargs)
    problems = []
    for record, prompt, example in zip(s.records, s.prompts, examples, strict=True):
        supervised = [i for i, keep in zip(example.ids, example.loss_mask, strict=True) if keep]
        if example.ids[: len(prompt)] != prompt:
            problems.append(f"{record['id']}: the SFT prompt ids differ from the RL prompt ids (I1)")
        if not supervised or supervised[-1] not in s.eos_ids:
            problems.append(f"{record['id']}: the supervised ids do not end with a stop token (I2)")
        if any(example.loss_mask[: len(prompt)]):
            problems.append(f"{record['id']}: prompt tokens carry loss")
    return bounded(
        "render_parity",
        "I1, I2",
        len(problems),
        0,
        f"{len(s.records)} records through sft.build_examples; " + "; ".join(problems),
        "the SFT example builder must render through chat.render_sft (the one renderer)",
    )


def check_special_tokens(s: Gated) -> Check:
    """I2, I5 at the tokenizer: the stop ids include eos and the template's end-of-turn token (Phi-3's
    ``<|end|>`` is not its eos), and no eos, pad or extra stop token is a turn-start token, the rendered
    prompt does not begin with a special token twice, and the tokenizer's eos is the model's own
    (``tokenizer_boundary.boundary_problems``: what a mis-converted GGUF tokenizer gets wrong)."""
    names = s.tokenizer.convert_ids_to_tokens(s.eos_ids)
    problems = boundary_problems(
        s.tokenizer, s.policy, s.cfg.model.extra_stop_tokens, s.cfg.model.chat_template_kwargs
    )
    if not s.eos_ids or s.tokenizer.eos_token_id not in s.eos_ids:
        problems.append("rollout.stop_ids must include the tokenizer's eos")
    detail = f"stop ids {s.eos_ids} = {names}, pad id {s.tokenizer.pad_token_id}"
    return bounded(
        "special_tokens", "I2, I5", len(problems), 0, "; ".join([detail, *problems]), "; ".join(problems)
    )


def _plain_token(s: Gated) -> int:
    """A token of the prompt that is neither special, pad nor a stop id."""
    special = set(s.tokenizer.all_special_ids) | set(s.eos_ids) | {s.tokenizer.pad_token_id}
    return next(t for t in s.prompts[-1] if t not in special)


class HandRollout(NamedTuple):
    rollout: Rollout  # what rollout_from_sequences made of the rows
    rows: list[list[int]]  # [N, C] the completions put after the prompts
    want: list[list[int]]  # [N, C] their right masks
    prompts: list[list[int]]  # [N] the prompt of every row


def _hand_rollout(s: Gated, tokenizer: Any = None) -> HandRollout:
    """``rollout_from_sequences`` on generate()-shaped rows: left-padded prompts of very different
    widths, then completions with a stop token mid-row and the pad id after it (and a sampled pad token
    mid-row when pad is not a stop id). ``tokenizer``: another pad than the configured one."""
    tokenizer = s.tokenizer if tokenizer is None else tokenizer
    pad, eos, word = tokenizer.pad_token_id, s.eos_ids[0], _plain_token(s)
    rows = [[word, word, eos, pad, pad, pad], [word, eos, eos, eos, pad, pad], [word] * 6]
    want = [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1] * 6]
    if pad not in s.eos_ids:  # a sampled pad token mid-row is an ordinary token: the mask goes on
        rows.append([word, pad, word, eos, pad, pad])
        want.append([1, 1, 1, 1, 0, 0])
    prompts = [s.prompts[i % len(s.prompts)] for i in range(len(rows))]
    prompt = left_pad(prompts, pad)
    sequences = torch.cat([prompt.input_ids, torch.tensor(rows)], dim=1)
    width = prompt.input_ids.shape[1]
    rollout = rollout_from_sequences(
        tokenizer, prompt, sequences, s.eos_ids, EosSuppressor(width, s.eos_ids, 0), 1, s.cfg.grpo.sampling
    )
    return HandRollout(rollout, rows, want, prompts)


def check_rollout_cut_and_mask(s: Gated) -> Check:
    """I4, I5: the rollout's ``rollout_from_sequences`` on ``_hand_rollout``'s rows, with the configured pad
    and (where the configured pad is a stop id, pad == eos as in Llama-3) with a pad that is not: the
    completions come back exactly (cut at the absolute prompt width), and the mask runs up to the first
    stop token and not one token past it, whatever id follows."""
    wrong_ids, wrong_mask, cases = [], [], []
    for tokenizer in (s.tokenizer, pad_not_stop(s.tokenizer, s.eos_ids)):
        if tokenizer is None:
            continue
        hand = _hand_rollout(s, tokenizer)
        label = "pad == a stop id" if tokenizer.pad_token_id in s.eos_ids else "pad != a stop id"
        cases.append(f"{len(hand.rows)} rows with {label}")
        wrong_ids += [
            f"{label} row {i}"
            for i, row in enumerate(hand.rows)
            if hand.rollout.completion_ids[i].tolist() != row
        ]
        wrong_mask += [
            f"{label} row {i}"
            for i in range(len(hand.rows))
            if hand.rollout.completion_mask[i].int().tolist() != hand.want[i]
        ]
    detail = (
        f"{'; '.join(cases)}, prompt widths {[len(p) for p in s.prompts]}; rows cut wrong: {wrong_ids}; "
        f"rows masked wrong: {wrong_mask}"
    )
    return bounded(
        "rollout_cut_and_mask",
        "I4, I5",
        len(wrong_ids) + len(wrong_mask),
        0,
        detail,
        "cut completions at the padded prompt width (not a per-row count) and mask up to the first "
        "stop token by position (never `ids != pad`)",
    )


def _batch_ids_problem(s: Gated) -> list[str]:
    """I3 on ids that do not survive a decode/encode round trip (a stop token, pads): the step's
    ``prepare_batch`` must hold exactly the prompt ids and then the rollout's ids."""
    hand = _hand_rollout(s).rollout
    n = len(hand.texts)
    records = [s.records[i % len(s.records)] for i in range(n)]
    batch = prepare_batch(s.ctx, Draw(hand, records, torch.zeros(n), torch.zeros(n), {}))
    joined = torch.cat([hand.prompt_ids, hand.completion_ids], dim=1)
    if torch.equal(batch.inputs.input_ids.cpu(), joined):
        return []
    return ["prepare_batch's ids are not the prompt ids then the rollout's ids (I3: never re-tokenise)"]


def _prompt_leaks(s: Gated, batch: ScoredBatch, rollout: Any) -> list[str]:
    """I3, I4: the step's joined ids are the prompt ids then the generated ids, and no completion
    starts with the tail of its own prompt (what a per-row cut of a left-padded row returns)."""
    problems = []
    width, g = rollout.prompt_ids.shape[1], rollout.group_size
    ids = batch.inputs.input_ids.cpu()
    if not torch.equal(ids[:, width:], rollout.completion_ids):
        problems.append("prepare_batch's completion ids are not the generated ids (I3)")
    for row in range(len(rollout.texts)):
        prompt = s.prompts[row // g]
        if ids[row, width - len(prompt) : width].tolist() != prompt:
            problems.append(f"row {row}: the prompt ids are not the rendered prompt")
        k = min(width - len(prompt), int(rollout.lengths[row]))
        if k >= 2 and rollout.completion_ids[row, :k].tolist() == prompt[-k:]:
            problems.append(f"row {row}: the completion starts with the last {k} prompt tokens (I4)")
    return problems


def check_left_padded_extraction(s: Gated) -> Check:
    """I3, I4, I11: the step's ``draw`` and ``prepare_batch`` on prompts of very different widths: the
    batch holds the generated ids after the prompt ids, no completion holds prompt text or a chat
    header, and each row scores the same alone as left-padded in the batch."""
    batch, sampled = step_batch(s, s.cfg.seed, group_size=1)
    rollout = sampled.rollout
    problems = _prompt_leaks(s, batch, rollout) + _batch_ids_problem(s)
    headers = set(s.tokenizer.convert_tokens_to_ids(header_tokens(s.tokenizer, s.eos_ids)))
    device = batch.inputs.input_ids.device
    with torch.no_grad():
        batched = score_inputs(s.policy, batch.inputs).logprobs.cpu()
    worst = 0.0
    for row, prompt in enumerate(s.prompts):
        n = int(rollout.lengths[row])
        completion = rollout.completion_ids[row, :n]
        alone = torch.tensor([prompt + completion.tolist()], device=device)
        with torch.no_grad():
            scored = score_completions(
                s.policy, alone, torch.ones_like(alone), n, rollout.temperature
            ).logprobs
        worst = max(worst, float((scored[0].cpu() - batched[row, :n]).abs().max()))
        if headers & set(completion.tolist()):
            problems.append(f"row {row}: a chat-header token in the completion")
    detail = f"max |logp alone - logp batched| over prompt widths {[len(p) for p in s.prompts]}"
    check = bounded(
        "left_padded_extraction",
        "I3, I4, I11",
        worst,
        s.tolerance(),
        detail,
        "score with position ids from the attention mask and the generated ids (I3, I11)",
    )
    if problems:
        return Check(
            check.name,
            "fail",
            worst,
            detail + "; " + "; ".join(problems),
            "join the generated ids to the prompt ids; cut at the padded prompt width",
            check.invariant,
            check.bound,
        )
    return check


def check_penalty_scope(s: Gated) -> Check:
    """I6: the rollout's processors (``build_logits_processors``, penalties and EOS suppression on)
    leave every non-stop logit alone at step 0, whatever the prompt repeats."""
    prompt = s.prompts[-1]
    sampling = s.cfg.grpo.sampling.model_copy(
        update={
            "presence_penalty": 1.0,
            "frequency_penalty": 1.0,
            "min_new_tokens": max(1, s.cfg.grpo.sampling.min_new_tokens),
        }
    )
    processors, _ = build_logits_processors(len(prompt), s.eos_ids, sampling)
    scores = torch.zeros(1, len(s.tokenizer))
    out = processors(torch.tensor([prompt]), scores.clone())
    others = torch.ones(scores.shape[-1], dtype=torch.bool)
    others[s.eos_ids] = False
    change = float((out[0, others] - scores[0, others]).abs().max())
    suppressed = bool(torch.isinf(out[0, s.eos_ids]).all())
    check = bounded(
        "penalty_scope",
        "I6",
        change,
        0.0,
        f"max change of a non-stop logit after a {len(prompt)}-token prompt, no completion yet",
        "penalties and EOS suppression must count completion tokens only (slice off the prompt)",
    )
    if not suppressed:
        return Check(
            check.name,
            "fail",
            change,
            check.detail + "; EOS was not suppressed at step 0",
            "EosSuppressor must count completion tokens only",
            check.invariant,
            check.bound,
        )
    return check


def _fresh_gap(s: Gated, model: torch.nn.Module, batch: ScoredBatch) -> float:
    """Max |the step's reference log-probs - ``model``'s| over the completion tokens, ``model`` scored part by
    part as the step scores its reference (the same forwards: in any precision the SFT weights agree
    exactly, where a model that is not them differs by far more)."""
    model.to(batch.inputs.input_ids.device).eval()
    other = score_parts(s.ctx, batch.inputs, batch.rows, adapter=True, model=model).logprobs
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
    with perturbed_policy(s.policy, s.cfg.seed):
        batch, _ = step_batch(
            s, s.cfg.seed + 1, num_iterations=2, loss={"beta": max(s.cfg.grpo.loss.beta, 0.04)}
        )
        kl = reference_kl(s.policy, batch.inputs, s.reference)
    sft_gap = _fresh_gap(s, s.sft, batch)
    base_gap = _fresh_gap(s, s.base, batch) if s.base is not None else None
    leak, own = _per_token_leak(batch.old_logprobs)
    same = s.tolerance() / 10  # 1e-5 in fp32; SFT and base log-probs differ by far more
    numbers = {
        "ref_vs_fresh_sft": sft_gap,
        "ref_vs_base": base_gap,
        "kl_perturbed": kl,
        "other_tokens_ratio_kl_change": leak,
        "own_ratio_error": own,
    }
    failures = [
        name
        for name, bad in (
            ("the reference is not the SFT weights (I9)", sft_gap > same),
            ("the reference equals the pre-SFT base (I9)", base_gap is not None and base_gap <= same),
            ("KL to the reference is 0 with a perturbed policy (I9)", not kl > 0.0),
            ("a one-token change moved other tokens' ratio or KL (I8)", leak > 1e-6),
            ("the changed token's ratio is not exp(0.1) (I8)", own > 1e-5),
        )
        if bad
    ]
    detail = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
    bound = {
        "ref_vs_fresh_sft": same,
        "ref_vs_base": f"> {same:g}",
        "kl_perturbed": "> 0",
        "other_tokens_ratio_kl_change": 1e-6,
        "own_ratio_error": 1e-5,
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


def _formula(step: Step, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's log-probs and entropy part by part as the step scores them (``update.part_rows``), and
    ``softmax(z / T)``'s written out in float64 on the raw logits of those very forwards
    (``logprobs.completion_logits``, the scorer's own forward, run again on the same rows): [N, C] each.
    The same forwards, so the gap measures the formula (the temperature, the log-softmax, the entropy),
    whatever the precision."""
    inputs, width = batch.inputs, batch.completion_mask.shape[1]
    shape = batch.completion_mask.shape
    scored_logp, scored_entropy = torch.zeros(shape), torch.zeros(shape)
    logp, entropy = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
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
        scored_logp[idx.cpu()], scored_entropy[idx.cpu()] = (
            scored.logprobs.float().cpu(),
            scored.entropy.float().cpu(),
        )
    return logp, entropy, torch.stack([scored_logp, scored_entropy])


def check_temperature(s: Gated) -> Check:
    """I10 at the configured temperature and at one != 1 (a missing division shows): the rollout
    records the temperature it sampled at, and the step's stored log-probs and the scorer's entropy
    are those of ``softmax(z / T)`` (perturbed policy, so it is not the SFT model)."""
    temperatures = sorted(
        {s.cfg.grpo.sampling.temperature, 0.5 if s.cfg.grpo.sampling.temperature == 1 else 1.0}
    )
    gaps, wrong_record = {}, []
    with perturbed_policy(s.policy, s.cfg.seed):
        for t in temperatures:
            batch, sampled = step_batch(s, s.cfg.seed + 2, num_iterations=2, sampling={"temperature": t})
            if sampled.rollout.temperature != t or batch.inputs.temperature != t:
                wrong_record.append(t)
            logp, manual_entropy, (scored_logp, entropy) = _formula(
                with_grpo(s.ctx, num_iterations=2, sampling={"temperature": t}), batch
            )
            mask = batch.completion_mask.cpu()
            gaps[f"T={t}"] = max(
                float((batch.old_logprobs.cpu().double() - logp).abs()[mask].max()),
                float((scored_logp.double() - logp).abs()[mask].max()),
                float((entropy.double() - manual_entropy).abs()[mask].max()),
            )
    worst = max(gaps.values())
    detail = (
        f"max |scored - written out| of the stored and fresh log-probs and the entropy, on the raw logits of "
        f"the step's own forwards: {gaps}"
    )
    check = bounded(
        "temperature",
        "I10",
        worst,
        s.tolerance(),
        detail,
        "divide the logits by the rollout's temperature before log-softmax AND entropy",
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
    )


def _inexact_value(group: int) -> float | None:
    """A reward whose fp32 mean over ``group`` equal copies differs from itself (float noise to mask)."""
    for value in (0.1, 0.2, 0.7, *(k / 100 for k in range(1, 100))):
        same = torch.full((1, group), value)
        if bool((same - same.mean(-1, keepdim=True)).any()):
            return value
    return None


def check_zero_variance_groups(s: Gated) -> Check:
    """I12: ``group_advantages`` with the configured scaling gives exactly 0 to groups of equal rewards
    whose fp32 mean is inexact (0.1/0.2/0.7-like), and counts them; a mixed group keeps its signal."""
    group = s.cfg.grpo.group_size
    sizes = [g for g in dict.fromkeys((group, 3)) if _inexact_value(g) is not None]
    worst, counted, mixed = 0.0, True, True
    used = {}
    for g in sizes:
        value = _inexact_value(g)
        used[g] = value
        rewards = torch.tensor([value] * g + [(0.1, 0.2, 0.7)[i % 3] for i in range(g)])
        advantages, stats = group_advantages(rewards, g, s.cfg.grpo.loss.scale_rewards)
        worst = max(worst, float(advantages[:g].abs().max()))
        counted &= stats["frac_reward_zero_std"] == 0.5
        mixed &= bool(advantages[g:].abs().max() > 0) and bool(torch.isfinite(advantages).all())
    detail = f"max |advantage| of equal-reward groups (group size: reward {used}, scale {s.cfg.grpo.loss.scale_rewards})"
    check = bounded(
        "zero_variance_groups",
        "I12",
        worst,
        0.0,
        detail,
        "mask equal-reward groups to advantage exactly 0; never divide float noise by a tiny epsilon",
    )
    if not (counted and mixed):
        return Check(
            check.name,
            "fail",
            worst,
            detail + "; frac_reward_zero_std or the mixed group is wrong",
            check.hint or "count equal-reward groups in frac_reward_zero_std",
            check.invariant,
            check.bound,
        )
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


FUNCTION_CHECKS: tuple[Callable[[Gated], Check], ...] = (
    check_render_parity,
    check_special_tokens,
    check_rollout_cut_and_mask,
    check_left_padded_extraction,
    check_penalty_scope,
    check_ratio_kl_reference,
    check_temperature,
    check_entropy_sign,
    check_zero_variance_groups,
    check_sampling_processors,
)
"""The checks that drive one stage function each with a probe built for its bug class."""
