"""The pre-flight checks of invariants I1-I12, each driving a stage's own function: here those of the
token boundary (I1-I6, I11), in ``scoring_checks.py`` those of scoring, the loss and the update, and
``FUNCTION_CHECKS`` lists them all.

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

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from grpo.checks.gated import Gated, pad_not_stop, step_batch
from grpo.checks.probes import Check, bounded
from grpo.checks.scoring_checks import (
    check_entropy_sign,
    check_ratio_kl_reference,
    check_sampling_processors,
    check_temperature,
    check_zero_variance_groups,
)
from grpo.checks.tokenizer_boundary import boundary_problems
from grpo.core.batching import left_pad
from grpo.core.logprobs import score_completions
from grpo.model.rollout import Rollout, rollout_from_sequences
from grpo.model.sampling import EosSuppressor, build_logits_processors
from grpo.model.scoring import score_inputs
from grpo.train.causal_lm import build_examples
from grpo.train.dynamic_sampling import Draw
from grpo.train.step import header_tokens, prepare_batch
from grpo.train.step_types import ScoredBatch


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
        "problems",
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
        "special_tokens",
        "I2, I5",
        len(problems),
        0,
        "; ".join([detail, *problems]),
        "; ".join(problems),
        "problems",
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
        "rows",
    )


def _batch_ids_problem(s: Gated) -> list[str]:
    """I3 on ids that do not survive a decode/encode round trip (a stop token, pads): the step's
    ``prepare_batch`` must hold exactly the prompt ids and then the rollout's ids."""
    hand = _hand_rollout(s).rollout
    n = len(hand.texts)
    records = [s.records[i % len(s.records)] for i in range(n)]
    batch = prepare_batch(s.step, Draw(hand, records, torch.zeros(n), torch.zeros(n), {}))
    joined = torch.cat([hand.prompt_ids, hand.completion_ids], dim=1)
    if torch.equal(batch.inputs.input_ids.cpu(), joined):
        return []
    return ["prepare_batch's ids are not the prompt ids then the rollout's ids (I3: never re-tokenise)"]


def _prompt_leaks(s: Gated, batch: ScoredBatch, rollout: Any) -> list[str]:
    """I3, I4: the rollout's completion ids are the ids the decode loop generated and recorded drawing, the
    step's joined ids are the prompt ids then those ids, and no completion starts with the tail of its own
    prompt (what a per-row cut of a left-padded row returns)."""
    problems = []
    width, g = rollout.prompt_ids.shape[1], rollout.group_size
    ids = batch.inputs.input_ids.cpu()
    if not torch.equal(ids[:, width:], rollout.completion_ids):
        problems.append("prepare_batch's completion ids are not the generated ids (I3)")
    generated = rollout.sequences[:, width:]  # what the decode loop returned after the prompts
    drawn = generated if rollout.sampler is None else rollout.sampler.ids  # what it recorded drawing
    if not (torch.equal(rollout.completion_ids, generated) and torch.equal(rollout.completion_ids, drawn)):
        problems.append("the rollout's completion ids are not the ids the decode loop generated and drew (I3)")
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
        "nats",
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
            check.unit,
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
        "logit",
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
            check.unit,
        )
    return check


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
