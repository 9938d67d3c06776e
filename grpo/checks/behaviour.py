"""Pre-flight checks of behaviour: what the stage code does, whichever way a bug in it was written.

- ``sft_supervises_stop`` (I2): the batch the SFT loop trains on (``causal_lm.batch_loss``, the loop's own
  function) puts loss on the stop token: its gradient reaches the logits that predict it.
- ``sft_ends_answers`` (I2): the SFT model, greedy, ends its answers with a stop token within the
  completion budget on eval prompts.
- ``processors_see_completion`` (I6): the step's own rollout (its engine: ``sample_rollout``) with a
  first prompt shorter than the others, its logits biased so the outcome is known: a presence and a
  frequency penalty leave the prompt's tokens alone, and EOS suppression counts completion tokens only.
- ``first_step`` (I8, I9): the trainer's first step from the starting weights, with its own context and
  optimizer, as a fresh run takes it (its own first-step check on), has ratio 1 and KL 0 (the reference is
  the SFT policy itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from grpo.checks.gated import Gated, restored
from grpo.checks.probes import Check, bounded
from grpo.config import SamplingConfig
from grpo.data.prompts import render_records
from grpo.model.chat import special_ids
from grpo.model.rollout import generate_rollout
from grpo.train.agreement import StepInvariantError
from grpo.train.causal_lm import batch_loss, build_examples
from grpo.train.step import grpo_step

BIAS = 200.0
"""Added to the logits a probe favours: far beyond any logit gap, so the outcome does not depend on them."""


@contextlib.contextmanager
def biased(model: torch.nn.Module, token_ids: list[int], bias: float = BIAS) -> Iterator[None]:
    """``model``'s logits with ``bias`` added at ``token_ids`` (a forward hook on its output layer)."""
    head = model.get_output_embeddings()

    def add(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        shift = torch.zeros(output.shape[-1], dtype=output.dtype, device=output.device)
        shift[token_ids] = bias
        return output + shift

    handle = head.register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()


def check_sft_supervises_stop(s: Gated) -> Check:
    """I2 in the SFT loop: the loss of each probe conversation, batched and scored by the loop's own
    ``batch_loss``, has a gradient at the logits that predict its last (stop) token."""
    examples = build_examples(s.records, s.tokenizer, s.cfg.sft.max_length, s.cfg.model.chat_template_kwargs)
    seen: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        output.retain_grad()
        seen.append(output)

    handle = s.sft.get_output_embeddings().register_forward_hook(keep)
    try:
        with torch.enable_grad():
            loss, _ = batch_loss(
                s.sft, examples, s.tokenizer.pad_token_id, next(s.sft.parameters()).device, s.cfg.sft.bf16
            )
            loss.backward()
    finally:
        handle.remove()
        s.sft.zero_grad(set_to_none=True)
    # Left padding puts every conversation's last token (its stop token) in the last column: the logits
    # of the column before predict it.
    reach = (
        seen[0].grad[:, -2].abs().sum(-1) if seen and seen[0].grad is not None else torch.zeros(len(examples))
    )
    unsupervised = int((reach == 0).sum())
    return bounded(
        "sft_supervises_stop",
        "I2",
        unsupervised,
        0,
        f"{len(examples)} probe conversations through causal_lm.batch_loss: {unsupervised} whose stop "
        "token carries no loss",
        "the SFT loss mask must keep the end-of-turn token (chat.render_sft)",
        "conversations",
    )


def check_sft_ends_answers(s: Gated) -> Check:
    """I2 in the trained SFT model: greedy answers to eval prompts end with a stop token in the budget."""
    cfg = s.cfg
    prompts = render_records(s.tokenizer, s.questions, cfg.model.chat_template_kwargs)
    with torch.no_grad(), s.step.autocast():
        rollout = generate_rollout(
            s.sft, s.tokenizer, prompts, 1, cfg.grpo.sampling, s.eos_ids, cfg.seed, greedy=True, fast=s.step.fast
        )
    ended = 1.0 - float(rollout.truncated.float().mean())
    detail = (
        f"{len(prompts)} prompts, greedy: {ended:.0%} of the SFT model's answers end with a stop token "
        f"within grpo.sampling.max_new_tokens={cfg.grpo.sampling.max_new_tokens}"
    )
    share = cfg.preflight.min_ended_share
    check = bounded(
        "sft_ends_answers",
        "I2",
        1.0 - ended,
        1.0 - share,
        detail,
        "the SFT model does not stop: check that SFT supervises the end-of-turn token (I2) and that "
        "it trained enough, or raise grpo.sampling.max_new_tokens",
    )
    return Check(
        check.name,
        check.status,
        ended,
        detail,
        check.hint,
        "I2",
        f">= {share} (preflight.min_ended_share)",
        "share",
    )


def _plain_last_token(s: Gated) -> int:
    """The last token of the shortest probe prompt that is not special: the end of the generation prompt,
    which a processor fed the prompt's last columns would see first."""
    specials = special_ids(s.tokenizer) | set(s.eos_ids)
    return next(t for t in reversed(s.prompts[0]) if t not in specials)


def check_processors_see_completion(s: Gated) -> Check:
    """I6 on the step's own rollout: the completions the engine samples when the logits are biased
    towards the prompt's last plain token X (a presence, then a frequency penalty of twice the bias) or
    towards the stop tokens (EOS suppression for ``min_new_tokens`` = 2). Counting completion tokens only,
    every row starts with X and does not repeat it, and every row stops exactly after two tokens."""
    base = s.cfg.grpo.sampling.model_copy(
        update={
            "top_k": 0,
            "top_p": 1.0,
            "max_new_tokens": 3,
            "min_new_tokens": 0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
    )
    with torch.no_grad(), s.step.autocast():
        problems = _penalty_problems(s, base) + _eos_suppression_problems(s, base)
    detail = f"{len(s.prompts)} prompts of widths {[len(p) for p in s.prompts]} (shortest first); " + (
        "; ".join(problems) or "penalties and EOS suppression acted on completion tokens only"
    )
    return bounded(
        "processors_see_completion",
        "I6",
        len(problems),
        0,
        detail,
        "build the rollout's processors with the padded prompt width (sampling.build_logits_processors)",
        "problems",
    )


def _penalty_problems(s: Gated, base: SamplingConfig) -> list[str]:
    """A presence, then a frequency penalty of twice the bias towards the prompt's last plain token X:
    every row's first completion token is X, and X does not come twice."""
    x, rows, problems = _plain_last_token(s), len(s.prompts), []
    for penalty in ("presence_penalty", "frequency_penalty"):
        sampling = base.model_copy(update={penalty: 2 * BIAS})
        with biased(s.policy, [x]):
            out = s.step.engine.generate(s.prompts, 1, sampling, s.eos_ids, s.cfg.seed).rollout
        first = out.completion_ids[:, 0].tolist()
        if first != [x] * rows:
            problems.append(
                f"with a {penalty} the first tokens are {first}, not the favoured {x} in every row: "
                "the penalty counted prompt tokens"
            )
        elif any(n > 1 and int(out.completion_ids[i, 1]) == x for i, n in enumerate(out.lengths.tolist())):
            problems.append(
                f"with a {penalty} the favoured token {x} came twice: the penalty missed the completion"
            )
    return problems


def _eos_suppression_problems(s: Gated, base: SamplingConfig) -> list[str]:
    """EOS suppression for ``min_new_tokens`` = 2 with the stop tokens favoured: every row stops exactly
    after two tokens."""
    sampling = base.model_copy(update={"min_new_tokens": 2})
    with biased(s.policy, list(s.eos_ids)):
        out = s.step.engine.generate(s.prompts, 1, sampling, s.eos_ids, s.cfg.seed).rollout
    if out.lengths.tolist() == [3] * len(s.prompts):
        return []
    return [
        f"with min_new_tokens=2 and the stop tokens favoured, the rows stopped after "
        f"{[n - 1 for n in out.lengths.tolist()]} tokens, not 2: EOS suppression counted prompt tokens"
    ]


def check_first_step(s: Gated) -> Check:
    """I8, I9 in the trainer's own step: its first step from the starting weights (fresh adapter, or the
    SFT weights against their frozen copy), with its context, reference and optimizer, has ratio 1 and
    KL 0 on every token: the step's own first-step check (``train/agreement.py``, as a fresh run does it) and
    its metrics. The weights and the optimizer are restored afterwards."""
    hint = (
        "at the start the policy is its reference: check the reference the trainer's step context "
        "gets (I9) and that old, new and reference log-probs are scored alike (I8, I10)"
    )
    with restored(s.step):
        try:
            metrics = grpo_step(
                s.variant(loss={"beta": max(s.cfg.grpo.loss.beta, 0.04)}), s.records, 1, lambda attempt: s.records,
                first=True,
            ).metrics
        except StepInvariantError as exc:
            return Check("first_step", "fail", None, str(exc), hint, exc.invariant, "the step's own bound")
    iterations = s.cfg.grpo.num_iterations
    if iterations > 1:  # the metrics are the last update's, after the first optimizer step moved the policy
        detail = (
            f"the step's own first-step check held on its first policy pass (grpo.num_iterations={iterations}: "
            "the metrics describe its last update)"
        )
        return bounded("first_step", "I8, I9", 0.0, 1e-6, detail, hint)
    ratio, kl, clipped = metrics["ratio/mean"], metrics["kl"], metrics["clip_ratio/region_mean"]
    worst = max(abs(ratio - 1.0), kl, clipped)
    detail = (
        f"the trainer's first step: ratio/mean {ratio:.9f}, kl {kl:.3g}, clip_ratio/region_mean {clipped}"
    )
    return bounded("first_step", "I8, I9", worst, 1e-6, detail, hint)
