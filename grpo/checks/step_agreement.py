"""The trainer's real step against the reference step written from scratch (``reference_step.py``).

The gate runs ``grpo_step`` itself, with the step ``build_step`` made for the trainer, on the probe records
and a policy moved away from its reference (so I8/I9 cannot hold by accident), and compares every
tensor that entered its loss (``StepTrace``) with the reference step's on the same generated tokens:
prompt and completion ids, the completion mask, the texts the rewards read, rewards, advantages, the
stored old and reference log-probs, the update's log-probs and entropy, the sampler's own log-prob of each
token it drew (``Rollout.sampler``), the per-task losses, KL and entropy, the combined gradient it stepped on
(taken from the optimizer at its step) and the update the optimizer made. The decoded tokens themselves:
the trainer's rollout function decoding greedily (its kept prefill, cache and fast paths) must give the
tokens the reference decodes from each prompt alone (``reference_step.greedy_problems``). The step's own
run-time checks (``train/agreement.py``) run inside it: a step they stop is a failure under the invariant
they name. Variants probe what one configuration cannot show:

- ``configured``: the params as they are (entropy bonus and KL switched on if off, so their signs show);
- ``T != 1``: another sampling temperature (I10: a scorer, or a sampler, that drops or repeats T);
- ``pad != stop``: a pad token that is not a stop token (I5: a mask that runs past the first stop; I3: a
  drawn stop token written as the pad id);
- ``two updates``: ``num_iterations: 2`` (the stored old log-probs, I8/I10);
- ``greedy, inexact means``: a temperature so low every group's rows are the same, and reward weights
  whose groups' fp32 mean is not their rewards (``inexact_weights``; at a power-of-two group size, where
  sums of equal numbers are exact, through the sum's overflow), so every group is one of equal rewards
  whose mean is float noise (I12);
- every multitask mode (``sum`` one backward and per task, ``pcgrad``, ``cagrad`` with one graph or one
  per task, ``reward_only``): the update's gradient on the configured variant's batch, and its gradient on
  the entropy bonus alone (zero advantages, no KL), whose sign a flip reverses (I7).

Each failure names the invariant of its quantity (``INVARIANTS``); a log-prob that fails only at T != 1 is
I10.

The step runs in fp32 here (its bf16 path differs only by the autocast around the same code): the
reference is fp32, and the bounds are fp32's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from grpo.checks.gated import Gated, pad_not_stop, perturbed_policy, restored, with_grpo
from grpo.checks.probes import Check
from grpo.checks.reference_step import ReferenceStep, greedy_problems, reference_step
from grpo.checks.scoring_checks import OVERFLOWING, inexact_value
from grpo.data.prompts import render_records
from grpo.model.rollout import sample_rollout
from grpo.train.agreement import StepInvariantError
from grpo.train.step import StepTrace, build_step, grpo_step
from grpo.train.step_types import Step
from grpo.train.update import NonFiniteError, global_totals, gradient

LOGPROB_BOUND = 1e-4
"""fp32: a row scored alone (the reference) and inside the padded, cached batch (the step), at T = 1; the
scaled logits z / T carry the logits' float noise divided by T, so below T = 1 the bound is this / T."""
COSINE_BOUND = 1e-4
"""1 - cosine of the step's gradient and the reference's (fp32 reassociation, CAGrad's dual solved two ways)."""
NORM_BOUND = 1e-3
"""Relative error of the gradient's norm."""
UPDATE_COSINE_BOUND = 1e-4
"""1 - cosine of the weights' change and the first AdamW step on the reference's clipped gradient."""
PROBE_TOKENS = 16
"""The probe's completions are at most this long (the configured length if shorter): the comparisons need
a stop token and a few tokens after it, not a full answer."""
NEAR_GREEDY = "greedy, inexact means"
GREEDY_TEMPERATURE = 1e-6
"""The I12 variant's temperature: every other token's probability underflows, so a group's rows are the same."""
NO_GRADIENT = (NEAR_GREEDY,)
"""Variants whose gradient is not compared: at T = 1e-6 every token's probability is 1, its policy
gradient the difference of equal numbers, whose float noise is not the step's doing (the variant is there
for its equal-reward groups, I12)."""
INVARIANTS = {
    "prompt_ids": "I1", "completion_ids": "I3", "joined_ids": "I3", "greedy_ids": "I3",
    "completion_mask": "I5", "reward_texts": "I4", "rewards": "I4", "advantages": "I12",
    "ref_logprobs": "I9", "old_logprobs": "I8", "logprobs": "I11", "entropy": "I10", "sampler_logprobs": "I10",
    "kl": "I8", "entropy_mean": "I7", "loss": "I7", "grad_norm": "I7", "gradient": "I7", "update": "I7",
    "entropy_gradient": "I7",
}
"""The invariant each compared quantity belongs to (``loss/<task>``, ``gradient[<mode>]`` by their stem)."""
UNTEMPERED = ("prompt_ids", "completion_ids", "joined_ids", "greedy_ids", "completion_mask", "reward_texts", "rewards",
              "advantages")
"""Quantities no scoring temperature enters; any other that fails only where T differs from the configured one
is I10."""
VARIANT_INVARIANTS = {"T=0.7": "I10", "T=1.0": "I10", "pad != stop": "I5", "two updates": "I8", NEAR_GREEDY: "I12"}
"""What a variant is there for: the invariant of a step it stops without naming one (a non-finite loss)."""
MODES = (
    {"mode": "sum"},
    {"mode": "sum", "task_stats": True},
    {"mode": "pcgrad"},
    {"mode": "cagrad", "low_memory": False},
    {"mode": "cagrad", "low_memory": True},
    {"mode": "pcgrad", "reward_only": True},
    {"mode": "cagrad", "reward_only": True},
)


@dataclasses.dataclass
class Optimised:
    """What the trainer's optimizer saw and did at its first step."""

    grad: torch.Tensor | None = None  # [P] the gradient it stepped on (clipped)
    before: torch.Tensor | None = None  # [P] the weights before
    after: torch.Tensor | None = None  # [P] the weights after
    lr: float = 0.0


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def run_step(step: Step, records: list[dict], seed_index: int) -> tuple[StepTrace, dict[str, Any], Optimised]:
    """The trainer's ``grpo_step`` on ``records``: its trace and metrics, and what its optimizer stepped on
    and did at its first step. The caller restores the weights (``restored``)."""
    seen = Optimised()

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if seen.grad is None:
            seen.grad = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in step.params])
            seen.before = _flat(step.params)
            seen.lr = float(optimizer.param_groups[0]["lr"])

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if seen.after is None:
            seen.after = _flat(step.params)

    handles = [
        step.optimizer.register_step_pre_hook(before_step),
        step.optimizer.register_step_post_hook(after_step),
    ]
    try:
        result = grpo_step(step, records, seed_index, lambda attempt: records)
    finally:
        for handle in handles:
            handle.remove()
    return result.trace, result.metrics, seen


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _cosine_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cosine(a, b); 0 when both are zero, 2 when one is."""
    a, b = a.double(), b.double()  # a float32 norm of millions of elements is off in its 4th digit
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 and nb == 0:
        return 0.0
    if na == 0 or nb == 0:
        return 2.0
    return 1.0 - float(a @ b) / (na * nb)


def _rows_differing(trace: StepTrace, ref: ReferenceStep) -> dict[str, float]:
    """How many rows' prompt ids, completion ids, completion mask, joined ids and reward texts differ from
    the reference's."""
    rollout, batch, n = trace.draw.rollout, trace.batch, len(ref.prompts)
    lengths = [len(c) for c in ref.completions]
    width = rollout.prompt_ids.shape[1]
    ids = batch.inputs.input_ids.cpu()
    counts = {
        "prompt_ids": sum(
            rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist() != ref.prompts[i] for i in range(n)
        ),
        "completion_ids": sum(
            rollout.completion_ids[i, : lengths[i]].tolist() != ref.completions[i] for i in range(n)
        ),
        "completion_mask": sum(
            rollout.completion_mask[i].int().tolist()
            != [1] * lengths[i] + [0] * (rollout.completion_mask.shape[1] - lengths[i])
            for i in range(n)
        ),
        "joined_ids": sum(
            ids[i, width - len(ref.prompts[i]) : width].tolist() != ref.prompts[i]
            or ids[i, width : width + lengths[i]].tolist() != ref.completions[i]
            for i in range(n)
        ),
        "reward_texts": sum(a != b for a, b in zip(rollout.texts, ref.texts, strict=True)),
    }
    return {key: float(value) for key, value in counts.items()}


def compare(
    trace: StepTrace, metrics: dict[str, Any] | None, ref: ReferenceStep
) -> dict[str, tuple[float, float]]:
    """``{quantity: (value, bound)}`` of the step against the reference; ids, masks and texts count rows.
    ``metrics``: the step's, when they describe its first update (one update per step), else None."""
    rollout, batch, n = trace.draw.rollout, trace.batch, len(ref.prompts)
    lengths = [len(c) for c in ref.completions]
    out = {key: (value, 0.0) for key, value in _rows_differing(trace, ref).items()}
    if any(out[key][0] for key in ("completion_ids", "completion_mask")):
        return out  # the per-token quantities below would compare different tokens
    out["rewards"] = (_gap(trace.draw.rewards, torch.tensor(ref.rewards)), 1e-6)
    out["advantages"] = (_gap(trace.draw.advantages, torch.tensor(ref.advantages)), 1e-5)

    def per_token(tensor: torch.Tensor | None, rows: list[torch.Tensor]) -> float:
        return (
            max(_gap(tensor[i, : lengths[i]].cpu(), rows[i].cpu()) for i in range(n))
            if tensor is not None
            else 0.0
        )

    bound = LOGPROB_BOUND / min(1.0, batch.inputs.temperature)
    sampler = rollout.sampler
    out["sampler_logprobs"] = (per_token(None if sampler is None else sampler.scored, ref.logprobs), bound)
    out["ref_logprobs"] = (per_token(batch.ref_logprobs, ref.ref_logprobs), bound)
    out["old_logprobs"] = (per_token(batch.old_logprobs, ref.logprobs), bound)
    out["logprobs"] = (per_token(trace.policy.logprobs, ref.logprobs), bound)
    out["entropy"] = (per_token(trace.policy.entropy, ref.entropy), bound)
    if metrics is None:
        return out
    for task, value in ref.task_losses.items():
        out[f"loss/{task}"] = (abs(metrics[f"loss/{task}"] - value), LOGPROB_BOUND * (1 + abs(value)))
    out["kl"] = (abs(metrics["kl"] - ref.kl), LOGPROB_BOUND * (1 + ref.kl))
    out["entropy_mean"] = (abs(metrics["entropy"] - ref.mean_entropy), LOGPROB_BOUND * (1 + ref.mean_entropy))
    return out


def compare_update(
    step: Step, metrics: dict[str, Any], seen: Optimised, ref: ReferenceStep
) -> dict[str, tuple[float, float]]:
    """The gradient the optimizer first stepped on, its norm, and the weights' change, against the reference
    (``grad_norm`` is the last update's: compared only with one update per step)."""
    direction = ref.direction(step.cfg.grpo.multitask).to(step.accelerator.device)
    norm = float(direction.norm())
    out = {}
    if step.cfg.grpo.num_iterations == 1:
        out["grad_norm"] = (abs(metrics["grad_norm"] - norm) / max(norm, 1e-12), NORM_BOUND)
    if seen.grad is None:  # no optimizer step: the step found a zero gradient
        out["gradient"] = (0.0 if norm == 0 else 2.0, COSINE_BOUND)
        return out
    clipped = direction * min(1.0, step.cfg.grpo.max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s rule
    out["gradient"] = (_cosine_gap(seen.grad, clipped), COSINE_BOUND)
    eps = step.optimizer.param_groups[0].get("eps", 1e-8)
    adam = -seen.lr * clipped / (clipped.abs() + eps)  # AdamW's first step: m = g, v = g^2 after correction
    # Both changes read as weights after minus weights before, rounded alike: a step far below a weight's
    # own size loses most of its digits in that subtraction.
    expected = (seen.before + adam) - seen.before
    out["update"] = (_cosine_gap(seen.after - seen.before, expected), UPDATE_COSINE_BOUND)
    return out


def _pad_not_stop(step: Step) -> Step | None:
    """The step with a tokenizer whose pad token is no stop token (``gated.pad_not_stop``), or None."""
    tokenizer = pad_not_stop(step.tokenizer, step.eos_ids)
    if tokenizer is None:
        return None
    return build_step(step.cfg, dataclasses.replace(step.policy, tokenizer=tokenizer), step.accelerator)


def inexact_weights(group: int) -> dict[str, float]:
    """Reward weights under which every group of ``group`` equal rewards has an fp32 mean that is not its
    rewards (float noise a zero-variance test must not read, I12): a weight like 0.1 where the group size
    gives an inexact sum (3, 5, 6, ...); at a power of two, where every partial sum of equal numbers is exact,
    a weight whose group sum overflows (for rewards of +-1 at every power-of-two size, of +-0.5 from four on):
    the mean is inf."""
    value = inexact_value(group)
    value = OVERFLOWING if value is None else value
    return {"fairness": value, "hallucination": value}


def variants(s: Gated) -> dict[str, Step]:
    """The trainer's step under each probed setting (``build_step`` again for each), in fp32."""
    grpo, loss = s.cfg.grpo, s.cfg.grpo.loss
    on = {"bf16": False, "loss": {"beta": max(loss.beta, 0.04), "entropy_coef": loss.entropy_coef or 0.01}}
    length = {"max_new_tokens": min(grpo.sampling.max_new_tokens, PROBE_TOKENS)}
    other_t = 0.7 if grpo.sampling.temperature == 1.0 else 1.0
    out = {
        "configured": s.variant(**on, sampling=length),
        f"T={other_t}": s.variant(**on, sampling=length | {"temperature": other_t}),
        "two updates": s.variant(**on, sampling=length, num_iterations=2),
    }
    weights = s.cfg.rewards.model_copy(
        update={"weights": s.cfg.rewards.weights.model_copy(update=inexact_weights(grpo.group_size))}
    )
    near_greedy = s.variant(**on, sampling=length | {"temperature": GREEDY_TEMPERATURE})
    out[NEAR_GREEDY] = dataclasses.replace(
        near_greedy, cfg=near_greedy.cfg.model_copy(update={"rewards": weights})
    )
    pad = _pad_not_stop(out["configured"])
    if pad is not None:
        out["pad != stop"] = pad
    return out


def invariant_of(key: str, other_temperature: bool, failed_configured: set[str]) -> str:
    """The invariant a failed quantity names: its own (``INVARIANTS``), or I10 for a quantity a scoring
    temperature enters that fails only in a variant sampled at another temperature than the configured."""
    stem = key.split("/")[0].split("[")[0]
    if other_temperature and stem not in UNTEMPERED and key not in failed_configured:
        return "I10"
    return INVARIANTS.get(stem, "I3-I12")


def _compared(s: Gated, name: str, step: Step) -> dict[str, tuple[float, float]]:
    """Every quantity of one variant against the reference step; the greedy tokens where the decode's stop
    tokens and cache matter (``configured``, ``pad != stop``), every multitask mode on ``configured``."""
    with restored(step):  # the step trains the weights: they come back before the reference scores
        trace, metrics, seen = run_step(step, s.records, 1)
    rollout = trace.draw.rollout  # the groups it trained on (dynamic sampling keeps and adds groups)
    ref = reference_step(step.cfg, step.model, s.sft, step.tokenizer, trace.draw.records, rollout.sequences,
                         rollout.prompt_ids.shape[1])
    found = compare(trace, metrics if step.cfg.grpo.num_iterations == 1 else None, ref)  # else: last update's
    if name not in NO_GRADIENT:
        found |= compare_update(step, metrics, seen, ref)
    if name in ("configured", "pad != stop"):
        found["greedy_ids"] = (float(len(greedy_problems(step.cfg, step.model, step.tokenizer, s.records,
                                                          _greedy(step, s.records)))), 0.0)
    if name == "configured":
        with restored(step):
            found |= _modes(step, trace, ref)
    return found


def check_step_agreement(s: Gated) -> Check:
    """I3-I12 on the trainer's own step: every tensor that enters its loss, its gradient and its update
    against the reference step (module docstring), in every variant and multitask mode; each failure names
    its invariant."""
    failures, worst, compared, named = [], {}, 0, set()
    probed = variants(s)
    failed_configured: set[str] = set()
    configured_t = probed["configured"].cfg.grpo.sampling.temperature
    with perturbed_policy(s.policy, s.cfg.seed):
        for name, step in probed.items():
            try:
                found = _compared(s, name, step)
            except (StepInvariantError, NonFiniteError) as exc:  # the step's own checks stopped it
                invariant = getattr(exc, "invariant", VARIANT_INVARIANTS.get(name, "I3-I12"))
                said = str(exc).split("; nothing of step")[0]  # a StepInvariantError names its invariant
                failures.append(f"{name}: the step stopped: {said}" + ("" if invariant in said else f" ({invariant})"))
                named.add(invariant)
                continue
            other_t = step.cfg.grpo.sampling.temperature != configured_t
            for key, (value, bound) in found.items():
                compared += 1
                worst[key] = max(worst.get(key, 0.0), value)
                if not value <= bound:  # a NaN fails
                    failed_configured |= {key} if name == "configured" else set()
                    invariant = invariant_of(key, other_t, failed_configured)
                    failures.append(f"{name}: {key} {value:.3g} > {bound:.3g} ({invariant})")
                    named.add(invariant)
    detail = (
        f"{compared} comparisons over {len(probed)} variants ({', '.join(probed)}) and {len(MODES)} modes; worst: "
        + ", ".join(f"{k} {v:.2g}" for k, v in worst.items())
    )
    return Check(
        "step_agreement",
        "fail" if failures else "pass",
        len(failures),
        detail + ("; " + "; ".join(failures[:12]) if failures else ""),
        "the trainer's step differs from the reference step in what the failures name: see "
        "grpo/checks/reference_step.py for what each quantity must be"
        if failures
        else "",
        ", ".join(sorted(named)) if failures else "I3-I12",
        0,
        "failures",
    )


def _greedy(step: Step, records: list[dict]) -> torch.Tensor:
    """The trainer's rollout function decoding ``records`` greedily as its engine samples them (the kept
    prefill, the shared one, the fast paths the step uses): its sequences [N, P + C]."""
    prompts = render_records(step.tokenizer, records, step.cfg.model.chat_template_kwargs)
    rollout, _ = sample_rollout(
        step.model, step.tokenizer, prompts, step.cfg.grpo.group_size, step.cfg.grpo.sampling, step.eos_ids,
        step.cfg.seed, greedy=True, shared_prefill=step.cfg.grpo.shared_prefix, fast=step.fast,
        **step.prefill_args(records),
    )
    return rollout.sequences


def _modes(configured: Step, trace: StepTrace, ref: ReferenceStep) -> dict[str, tuple[float, float]]:
    """The update's gradient (before clipping) in every multitask mode on the configured variant's batch."""
    out = {}
    batch = dataclasses.replace(
        trace.batch, prefills=()
    )  # the kept prefill is of the weights before the step
    bonus = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))  # only the entropy acts
    for mode in MODES:
        multitask = configured.cfg.grpo.multitask.model_copy(update=mode)
        grpo = configured.cfg.grpo.model_copy(update={"multitask": multitask})
        step = build_step(configured.cfg.model_copy(update={"grpo": grpo}), configured.policy, configured.accelerator)
        direction = gradient(step, batch, global_totals(step, batch)).direction
        want = ref.direction(multitask).to(direction.device)
        label = "+".join(f"{k}={v}" for k, v in mode.items())
        out[f"gradient[{label}]"] = (_cosine_gap(direction, want), COSINE_BOUND)
        out[f"grad_norm[{label}]"] = (
            abs(float(direction.norm()) - float(want.norm())) / max(float(want.norm()), 1e-12),
            NORM_BOUND,
        )
        alone = with_grpo(step, loss={"beta": 0.0})  # I7: the bonus alone, whose sign a flip reverses (gap 2)
        direction = gradient(alone, bonus, global_totals(alone, bonus)).direction
        out[f"entropy_gradient[{label}]"] = (
            _cosine_gap(direction, ref.entropy_only().direction(multitask).to(direction.device)),
            COSINE_BOUND,
        )
    return out
