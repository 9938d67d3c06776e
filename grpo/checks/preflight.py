"""Stage ``preflight``: the invariants I1-I12 checked on the configured tokenizer and model.

The unit tests prove the invariants on the tiny model; this stage re-runs the checks that can be run
against whatever model and tokenizer ``params.yaml`` configures, before any GPU time is spent. It writes
``reports/preflight.json`` (each check, pass/fail, its numbers) together with the lineage it was run
for; ``grpo train`` refuses to start unless a passing report exists for the current lineage.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo import paths
from grpo.config import Config
from grpo.core.advantages import group_advantages
from grpo.core.batching import completion_mask, join_prompt_completion, position_ids_from_mask
from grpo.core.logprobs import score_completions, selective_log_softmax
from grpo.core.losses import masked_mean, policy_loss_terms
from grpo.core.multitask import TaskLoss, multitask_backward
from grpo.data.jsonl import read_records
from grpo.data.prompts import example_messages, sft_target
from grpo.errors import GrpoError
from grpo.files import write_atomically
from grpo.model.chat import render_prompt, render_sft
from grpo.model.device import make_accelerator, model_device, to_device
from grpo.model.load import load_sft
from grpo.model.modeling import wrap_lora
from grpo.model.rollout import generate_rollout, stop_ids
from grpo.model.sampling import CompletionPenalty, EosSuppressor
from grpo.provenance.gate import REPORT_NAME, PreflightError, preflight_lineage
from grpo.seeding import derive_seed
from grpo.train.step import header_tokens


@dataclass
class Check:
    name: str
    invariant: str
    passed: bool
    numbers: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass
class Subject:
    """What the checks run on: the configured SFT model as a LoRA policy, its tokenizer, sample prompts."""

    cfg: Config
    policy: torch.nn.Module
    tokenizer: Any
    eos_ids: list[int]
    records: list[dict]
    prompts: list[list[int]]


def report_path(cfg: Config) -> Path:
    return paths.report_file(cfg, REPORT_NAME)


# --------------------------------------------------------------------------- the checks


def check_render_parity(s: Subject) -> Check:
    """I1, I2: SFT prompt ids == RL prompt ids; the supervised ids are the target plus end-of-turn."""
    kwargs = s.cfg.model.chat_template_kwargs
    problems = []
    for record in s.records:
        messages = example_messages(record)
        prompt = render_prompt(s.tokenizer, messages, **kwargs)
        example = render_sft(s.tokenizer, messages, sft_target(record), **kwargs)
        supervised = [i for i, keep in zip(example.ids, example.loss_mask, strict=True) if keep]
        if example.ids[: len(prompt)] != prompt:
            problems.append(f"{record['id']}: prompt ids differ")
        if not supervised or supervised[-1] not in s.eos_ids:
            problems.append(f"{record['id']}: supervised ids do not end with an end-of-turn token")
        if any(example.loss_mask[: len(prompt)]):
            problems.append(f"{record['id']}: prompt tokens carry loss")
    return Check("render_parity", "I1, I2", not problems, {"records": len(s.records)}, "; ".join(problems))


def check_eos_ids(s: Subject) -> Check:
    """Stop ids include eos and the template's end-of-turn token (Phi-3: <|end|> is not eos)."""
    names = s.tokenizer.convert_ids_to_tokens(s.eos_ids)
    ok = bool(s.eos_ids) and s.tokenizer.eos_token_id in s.eos_ids
    return Check("eos_ids", "I2, I5", ok, {"eos_ids": s.eos_ids, "tokens": names,
                                          "pad_id": s.tokenizer.pad_token_id})


def check_left_padded_extraction(s: Subject) -> Check:
    """I3, I4, I11: completions cut at the absolute prompt width score the same alone and batched,
    and hold no chat-header token (a header means prompt text leaked into the completion)."""
    rollout = generate_rollout(s.policy, s.tokenizer, s.prompts, 1, s.cfg.grpo.sampling, s.eos_ids, s.cfg.seed)
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    device = model_device(s.policy)
    input_ids, attention_mask = to_device(device, joined.input_ids, joined.attention_mask)
    temperature = s.cfg.grpo.sampling.temperature
    with torch.no_grad():
        batched = score_completions(s.policy, input_ids, attention_mask,
                                    rollout.completion_ids.shape[1], temperature).logprobs.cpu()
    headers = set(s.tokenizer.convert_tokens_to_ids(header_tokens(s.tokenizer, s.eos_ids)))
    worst, leaked = 0.0, []
    for row, prompt in enumerate(s.prompts):
        n = int(rollout.lengths[row])
        completion = rollout.completion_ids[row, :n]
        alone_ids = torch.tensor([prompt + completion.tolist()], device=device)
        with torch.no_grad():
            alone = score_completions(s.policy, alone_ids, torch.ones_like(alone_ids), n, temperature).logprobs
        worst = max(worst, float((alone[0].cpu() - batched[row, :n]).abs().max()))
        if headers & set(completion.tolist()):
            leaked.append(row)
    tolerance = 1e-4 if next(s.policy.parameters()).dtype == torch.float32 else 5e-2
    ok = worst <= tolerance and not leaked
    numbers = {"max_abs_logprob_diff": worst, "tolerance": tolerance, "prompt_widths": [len(p) for p in s.prompts]}
    return Check("left_padded_extraction", "I3, I4, I11", ok, numbers,
                 f"rows with a chat-header token in the completion: {leaked}" if leaked else "")


def check_completion_mask(s: Subject) -> Check:
    """I5: the mask comes from positions up to the first stop token, correct when pad == eos."""
    pad, eos = s.tokenizer.pad_token_id, s.eos_ids[0]
    word = s.prompts[0][-1]
    ids = torch.tensor([[word, word, eos, pad, pad], [eos, pad, pad, pad, pad], [word] * 5])
    got = completion_mask(ids, s.eos_ids)
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ok = torch.equal(got.mask, want) and got.truncated.tolist() == [False, False, True]
    return Check("completion_mask", "I5", ok, {"pad_equals_eos": pad in s.eos_ids,
                                               "lengths": got.lengths.tolist()})


def check_penalty_scope(s: Subject) -> Check:
    """I6: penalties and EOS suppression look at completion tokens only."""
    prompt = s.prompts[0]
    ids = torch.tensor([prompt])  # step 0: a prompt (with repeated template tokens), no completion yet
    scores = torch.zeros(1, len(s.tokenizer))
    penalised = CompletionPenalty(len(prompt), 1.0, 1.0)(ids, scores.clone())
    suppressor = EosSuppressor(len(prompt), s.eos_ids, 1)
    suppressed = suppressor(ids, scores.clone())
    others = torch.ones(scores.shape[-1], dtype=torch.bool)
    others[s.eos_ids] = False
    ok = (torch.equal(penalised, scores) and bool(torch.isinf(suppressed[0, s.eos_ids]).all())
          and torch.equal(suppressed[0, others], scores[0, others]))
    return Check("penalty_scope", "I6", ok, {"prompt_tokens": len(prompt),
                                             "max_change_from_penalty": float((penalised - scores).abs().max())})


def _sampled_batch(s: Subject):
    rollout = generate_rollout(s.policy, s.tokenizer, s.prompts[:1], max(2, s.cfg.grpo.group_size),
                               s.cfg.grpo.sampling, s.eos_ids, derive_seed(s.cfg.seed, ("preflight_batch", 1)))
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    return to_device(model_device(s.policy), joined.input_ids, joined.attention_mask, rollout.completion_mask)


def check_ratio_kl_at_init(s: Subject) -> Check:
    """I8, I9, I10: at step 0 ratio == 1 and KL == 0 against the adapter-disabled SFT policy."""
    input_ids, attention_mask, mask = _sampled_batch(s)
    width, temperature = mask.shape[1], s.cfg.grpo.sampling.temperature
    with torch.no_grad():
        scored = score_completions(s.policy, input_ids, attention_mask, width, temperature)
        with s.policy.disable_adapter():
            ref = score_completions(s.policy, input_ids, attention_mask, width, temperature).logprobs
        logits = s.policy(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask)).logits
    manual = selective_log_softmax(logits[:, -width - 1 : -1].float() / temperature, input_ids[:, -width:])
    _, stats = policy_loss_terms(
        scored.logprobs, scored.logprobs.detach(), ref, torch.ones(len(mask), device=mask.device), mask,
        scored.entropy, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", max_completion_length=width)
    temp_gap = float(((manual - scored.logprobs).abs() * mask).max())
    ok = stats["ratio/mean"] == 1.0 and stats["kl"] == 0.0 and temp_gap <= 1e-4
    return Check("ratio_kl_at_init", "I8, I9, I10", ok, {"ratio_mean": stats["ratio/mean"], "kl": stats["kl"],
                                                       "temperature_scaling_gap": temp_gap})


def _mean_entropy(model, input_ids, attention_mask, mask, temperature) -> float:
    with torch.no_grad():
        entropy = score_completions(model, input_ids, attention_mask, mask.shape[1], temperature).entropy
    return float(masked_mean(entropy, mask))


def check_entropy_sign(s: Subject) -> Check:
    """I7: one step on the entropy bonus alone raises entropy in the configured multitask mode."""
    input_ids, attention_mask, mask = _sampled_batch(s)
    temperature, mt = s.cfg.grpo.sampling.temperature, s.cfg.grpo.multitask
    policy = copy.deepcopy(s.policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    half = len(mask) // 2
    rows = {"fairness": torch.arange(half), "hallucination": torch.arange(half, len(mask))}

    def losses(tasks, micro=0):
        out = {}
        for task in tasks:
            idx = rows[task].to(mask.device)
            scored = score_completions(policy, input_ids[idx], attention_mask[idx], mask.shape[1], temperature)
            terms, _ = policy_loss_terms(
                scored.logprobs, scored.logprobs.detach(), None, torch.zeros(len(idx), device=mask.device),
                mask[idx], scored.entropy, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo",
                max_completion_length=mask.shape[1])
            out[task] = TaskLoss(terms)
        return out

    before = _mean_entropy(policy, input_ids, attention_mask, mask, temperature)
    multitask_backward(params, losses, tuple(rows), mode=mt.mode, c=mt.cagrad_c, rescale=mt.cagrad_rescale,
                       reward_only=mt.reward_only, low_memory=mt.low_memory, beta=0.0, entropy_coef=1.0)
    with torch.no_grad():
        for p in params:
            p -= 0.05 * p.grad / (p.grad.norm() + 1e-12)
    after = _mean_entropy(policy, input_ids, attention_mask, mask, temperature)
    return Check("entropy_sign", "I7", after > before, {"mode": mt.mode, "reward_only": mt.reward_only,
                                                       "low_memory": mt.low_memory, "before": before, "after": after})


def check_zero_variance_groups(s: Subject) -> Check:
    """I12: equal rewards in every group give advantage exactly 0 and are counted."""
    group = s.cfg.grpo.group_size
    rewards = torch.tensor([1.0] * group + [0.0] * group)
    advantages, stats = group_advantages(rewards, group, s.cfg.grpo.loss.scale_rewards)
    ok = bool((advantages == 0).all()) and stats["frac_reward_zero_std"] == 1.0
    return Check("zero_variance_groups", "I12", ok, {"frac_reward_zero_std": stats["frac_reward_zero_std"]})


CHECKS: tuple[Callable[[Subject], Check], ...] = (
    check_render_parity, check_eos_ids, check_left_padded_extraction, check_completion_mask,
    check_penalty_scope, check_ratio_kl_at_init, check_entropy_sign, check_zero_variance_groups,
)


# --------------------------------------------------------------------------- running and gating


def make_subject(cfg: Config, model, tokenizer, records: list[dict]) -> Subject:
    """``model`` wrapped as the GRPO policy (fresh LoRA, seeded) and one prompt per task, chosen so
    the two prompt widths differ as much as possible (the shorter one is the one left padding shifts)."""
    torch.manual_seed(cfg.seed)
    policy = wrap_lora(model, cfg.model.lora).to(make_accelerator(cfg).device)
    kwargs = cfg.model.chat_template_kwargs

    def rendered(task: str) -> list[tuple[list[int], dict]]:
        picked = [r for r in records if r["task"] == task][:5]
        return [(render_prompt(tokenizer, example_messages(r), **kwargs), r) for r in picked]

    pools = [pool for pool in (rendered("fairness"), rendered("hallucination")) if pool]
    if len(pools) == 2:
        pairs = [(a, b) for a in pools[0] for b in pools[1]]
        chosen = list(max(pairs, key=lambda pair: abs(len(pair[0][0]) - len(pair[1][0]))))
    else:
        chosen = pools[0][:2]
    chosen.sort(key=lambda item: len(item[0]))
    eos_ids = stop_ids(model, tokenizer, cfg.model.extra_stop_tokens)
    return Subject(cfg, policy, tokenizer, eos_ids, [r for _, r in chosen], [p for p, _ in chosen])


def run_checks_on(subject: Subject) -> list[Check]:
    """Every check; one that raises a project error counts as failed, with the error as its detail."""
    checks = []
    for check in CHECKS:
        try:
            checks.append(check(subject))
        except GrpoError as exc:
            checks.append(Check(check.__name__.removeprefix("check_"), "", False, {}, str(exc)))
    return checks


def run_checks(cfg: Config) -> dict[str, Any]:
    model, tokenizer = load_sft(cfg)
    records = read_records(paths.data_file(cfg, "train"))
    checks = run_checks_on(make_subject(cfg, model, tokenizer, records))
    return {"passed": all(c.passed for c in checks), "checks": [asdict(c) for c in checks],
            "lineage": preflight_lineage(cfg)}


def write_report(cfg: Config, report: dict[str, Any]) -> None:
    path = report_path(cfg)
    rows = ["| check | invariant | result | numbers |", "| --- | --- | --- | --- |"]
    for c in report["checks"]:
        numbers = ", ".join(f"{k}={v}" for k, v in c["numbers"].items())
        rows.append(f"| {c['name']} | {c['invariant']} | {'pass' if c['passed'] else 'FAIL'} | {numbers} "
                    f"{c['detail']} |")
    write_atomically({path: json.dumps(report, indent=2, default=str) + "\n",
                      path.with_suffix(".md"): "# Pre-flight\n\n" + "\n".join(rows) + "\n"})


def run(cfg: Config) -> int:
    report = run_checks(cfg)
    write_report(cfg, report)
    for c in report["checks"]:
        print(f"preflight: {'pass' if c['passed'] else 'FAIL'}  {c['name']:<24} {c['invariant']:<12} {c['detail']}")
    if not report["passed"]:
        raise PreflightError(f"pre-flight failed; see {report_path(cfg)} for the numbers")
    return 0
