"""Pre-flight check ``fast_paths``: every fast path the run uses, against the library's own path, where the gate
runs (``model.fast_paths``, ``grpo/model/fast/``).

Each fast path claims the library's tokens bit for bit (``docs/performance.md``); here the claim is held on
the configured model, in fp32, on probe prompts whose tasks interleave (fairness, hallucination,
hallucination, fairness: the kept prefill's rows, one forward per task, then come in an order that is not its
own inverse, where a slip in mapping them back to the prompts shows), sampled at a temperature other than 1
(``PROBE_TEMPERATURE`` where the configured one is 1, so a path that divides by it twice shows):

- the step's rollout, through its own engine as the step calls it (the decode loop, its lean or graph step,
  the kept prefill of the prompts, the draws), against ``model.fast_paths: off`` (``generate`` from its own
  prefill, ``torch.multinomial``) from the same seed: the same ids in every row;
- what the decode recorded for each token it drew (``Rollout.sampler``): its ids are the rollout's, and each
  row's completion mask ends at the first stop token it drew;
- evaluation's samples, started from its greedy pass where they may (``PromptPass``), against the samples of
  the library's path: the same greedy replies and the same sampled replies, drawn from the same
  distributions (their per-token entropies within ``ENTROPY_BOUND``: a peaked model draws the same tokens
  from a wrong cache).
"""

from __future__ import annotations

import torch

from grpo.checks.gated import Gated
from grpo.checks.probes import Check, bounded
from grpo.config import SamplingConfig
from grpo.core.batching import completion_mask
from grpo.data.prompts import render_records
from grpo.model.engines import HFEngine
from grpo.model.fast import FastPaths
from grpo.model.rollout import Rollout, generate_rollout

OFF = FastPaths("off")
ENTROPY_BOUND = 1e-4
"""fp32: the samples' entropies from a kept greedy pass and from their own prefill agree to ~1e-6 (the cache is
the same bit for bit; the decode step's and ``generate``'s forwards differ in their last bits)."""
PROBE_TEMPERATURE = 0.7
"""The probes sample at the configured temperature, or at this one where that is 1: at T = 1 a path that
divides by the temperature twice, or not at all, draws the same tokens as one that divides once."""


def interleaved(records: list[dict]) -> list[dict]:
    """Four probe records whose tasks interleave as ``a, b, b, a`` (``a, a, a, a`` with one task)."""
    first = records[0]
    other = next((r for r in records if r["task"] != first["task"]), first)
    return [first, other, other, first]


def _differing(a: Rollout, b: Rollout) -> list[int]:
    """Rows whose completions (ids and mask) differ."""
    if a.completion_ids.shape != b.completion_ids.shape:
        return list(range(len(a.texts)))
    same = (a.completion_ids == b.completion_ids).all(1) & (a.completion_mask == b.completion_mask).all(1)
    return (~same).nonzero().flatten().tolist()


def _entropy_differs(a: Rollout, b: Rollout, bound: float = ENTROPY_BOUND) -> list[int]:
    """Rows of equal completions whose per-token entropies differ by more than ``bound``: the logits they were
    drawn from differ (a peaked model can draw the same tokens from a wrong cache)."""
    if a.entropy is None or b.entropy is None or a.entropy.shape != b.entropy.shape:
        return list(range(len(a.texts)))
    return (~((a.entropy - b.entropy).abs().amax(1) <= bound)).nonzero().flatten().tolist()  # a NaN differs


def _recorded(rollout: Rollout, eos_ids: list[int]) -> list[int]:
    """Rows whose recorded draws are not their completion ids, or whose mask does not end at the drawn stop."""
    record = rollout.sampler
    if record is None:
        return list(range(len(rollout.texts)))
    wrong = (record.ids != rollout.completion_ids).any(1)
    wrong |= (completion_mask(record.ids, eos_ids).mask != rollout.completion_mask).any(1)
    return wrong.nonzero().flatten().tolist()


def _step_rollouts(s: Gated, records: list[dict]) -> tuple[Rollout, Rollout]:
    """The step's engine on ``records`` as the step calls it, and the library path's engine, one seed."""
    step, group = s.step, s.cfg.grpo.group_size
    prompts = render_records(step.tokenizer, records, s.cfg.model.chat_template_kwargs)
    args = step.prefill_args(records)
    sampling, seed = _probe_sampling(s), s.cfg.seed
    fast = step.engine.generate(prompts, group, sampling, step.eos_ids, seed, **args).rollout
    library = HFEngine(step.model, step.tokenizer, s.cfg.grpo.shared_prefix, fast=OFF)
    plain = {**args, "keep_prefill": False}  # the same passes over the prompts, without the kept graph
    return fast, library.generate(prompts, group, sampling, step.eos_ids, seed, **plain).rollout


def _probe_sampling(s: Gated) -> SamplingConfig:
    """The configured sampling, at ``PROBE_TEMPERATURE`` where the configured temperature is 1."""
    sampling = s.cfg.grpo.sampling
    return sampling if sampling.temperature != 1.0 else sampling.model_copy(update={"temperature": PROBE_TEMPERATURE})


def _evaluation(s: Gated, records: list[dict], fast: FastPaths) -> tuple[Rollout, Rollout]:
    """Evaluation's two decodes of a batch (``eval.evaluate.evaluate_model``): greedy, then the samples
    started from that greedy pass where ``fast`` allows (``FastPaths.prompt_pass``)."""
    step = s.step
    prompts = render_records(step.tokenizer, records, s.cfg.model.chat_template_kwargs)
    shared = fast.prompt_pass()
    args = (step.model, step.tokenizer, prompts)
    greedy = generate_rollout(*args, 1, _probe_sampling(s), step.eos_ids, s.cfg.seed, greedy=True,
                              prompt_pass=shared, fast=fast)
    sampled = generate_rollout(*args, s.cfg.grpo.group_size, _probe_sampling(s), step.eos_ids, s.cfg.seed,
                               shared_prefill=True, with_entropy=True, prompt_pass=shared, fast=fast)
    return greedy, sampled


def check_fast_paths(s: Gated) -> Check:
    """The fast paths in use against the library's paths (module docstring): rows that differ, in fp32."""
    if s.step.fast.setting == "off":
        return Check("fast_paths", "pass", 0, "model.fast_paths: off: the library's paths run", "", "I3, I10", 0)
    if not isinstance(s.step.engine, HFEngine):
        return Check("fast_paths", "skip", 0, f"the {s.step.engine.name} engine samples, not the decode loop", "",
                     "I3, I10", 0)
    records = interleaved(s.records)
    problems = {}
    with torch.no_grad():
        fast, library = _step_rollouts(s, records)
        problems["step rollout rows unlike generate's"] = _differing(fast, library)
        problems["rows whose recorded draws are not their ids or stop"] = _recorded(fast, s.eos_ids)
        ours, theirs = _evaluation(s, records, s.step.fast), _evaluation(s, records, OFF)
        problems["evaluation's greedy replies unlike the library's"] = _differing(ours[0], theirs[0])
        problems["evaluation's samples unlike the library's"] = _differing(ours[1], theirs[1])
        if not problems["evaluation's samples unlike the library's"]:
            problems[f"evaluation's sample entropies off the library's by > {ENTROPY_BOUND}"] = _entropy_differs(
                ours[1], theirs[1])
    wrong = {what: rows for what, rows in problems.items() if rows}
    detail = (
        f"{s.step.fast.report()}; {len(records)} prompts (tasks {[r['task'] for r in records]}), "
        f"{s.cfg.grpo.group_size} samples each at T={_probe_sampling(s).temperature}, against model.fast_paths: "
        "off from the same seed"
        + "".join(f"; {what}: {rows}" for what, rows in wrong.items())
    )
    return bounded(
        "fast_paths",
        "I3, I10",
        sum(len(rows) for rows in wrong.values()),
        0,
        detail,
        "a fast path changed the tokens: run with model.fast_paths: off to confirm, and see docs/performance.md "
        "for what each path must match",
    )
