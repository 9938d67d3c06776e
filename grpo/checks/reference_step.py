"""A GRPO step written from scratch in plain torch, to hold the trainer's step to.

It shares nothing with the fast path but the model's forward, the tokenizer, the records' messages and
the reward functions (what the tasks are). It decodes greedily from each prompt on its own, no cache
(``greedy_problems``: the trainer's rollout function decoding greedily must give those tokens). From the
records and the tokens the decode loop generated
(``Rollout.sequences``) it renders its own prompts (``apply_chat_template``), finds the stop tokens
itself, cuts each completion at the prompt width and masks it by position, decodes the texts the
rewards read, takes the group advantages in a loop, scores each row ALONE (no padding, no cache,
fp32, float64 softmax, ``z / T``), scores the reference with a fresh load of the SFT weights (I9),
writes the k3 KL, the clipped surrogate, the entropy bonus and the configured aggregation out, takes
each task's gradient with ``torch.autograd.grad`` and combines them (sum, PCGrad, CAGrad, reward_only)
by its own arithmetic. ``grpo/checks/step_agreement.py`` compares every one of these with the
trainer's step (``StepTrace``) and its gradient, to stated bounds.

Slow on purpose: one forward per row and per model, one backward per task; the gate runs it on a few
probe prompts.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo.config import Config, MultitaskConfig
from grpo.data.prompts import example_messages
from grpo.data.schema import TASKS
from grpo.rewards import weighted_reward

ADVANTAGE_EPS = 1e-4  # the std's epsilon of GRPO's advantage (r - mean) / (std + eps)
TIE_BOUND = 1e-4
"""Logits closer than this are a tie for the greedy comparison: fp32 noise of two forwards may order them
either way."""


@dataclass(frozen=True)
class ReferenceStep:
    """What a plain GRPO step computes for one batch (row ``i`` answers ``records[i // G]``)."""

    prompts: list[list[int]]  # [N] each row's prompt ids, its own rendering
    completions: list[list[int]]  # [N] the generated ids up to and including the first stop token
    texts: list[str]  # [N] what the rewards read
    rewards: list[float]  # [N]
    advantages: list[float]  # [N]
    logprobs: list[torch.Tensor]  # [N] per row [len_i]: the policy at the step's start, z / T
    ref_logprobs: list[torch.Tensor]  # [N] per row [len_i]: the fresh SFT weights
    entropy: list[torch.Tensor]  # [N] per row [len_i]
    task_losses: dict[str, float]  # task -> policy + beta * kl - entropy_coef * entropy
    kl: float  # token mean over the batch
    mean_entropy: float  # token mean over the batch
    policy_grads: dict[str, torch.Tensor]  # task -> [P] d policy term / d trainable weights
    regulariser_grads: dict[str, torch.Tensor]  # task -> [P] d (beta * kl - entropy_coef * entropy)
    entropy_grads: dict[str, torch.Tensor]  # task -> [P] d (- entropy_coef * entropy): the bonus alone

    def entropy_only(self) -> ReferenceStep:
        """This step with zero advantages and beta 0: only the entropy bonus has a gradient (I7)."""
        zeros = {task: torch.zeros_like(g) for task, g in self.policy_grads.items()}
        return dataclasses.replace(self, policy_grads=zeros, regulariser_grads=self.entropy_grads)

    def direction(self, multitask: MultitaskConfig) -> torch.Tensor:
        """The combined gradient ``[P]`` (before clipping) in ``multitask``'s mode: each task's whole
        gradient combined, or (``reward_only``) the policy gradients combined and the others added."""
        if multitask.reward_only:
            grads = list(self.policy_grads.values())
        else:
            grads = [self.policy_grads[t] + self.regulariser_grads[t] for t in self.policy_grads]
        combined = [g for g in grads if bool(g.any())]  # a task with nothing to learn takes no part
        if not combined:
            direction = torch.zeros_like(grads[0])
        elif multitask.mode == "sum":
            direction = torch.stack(combined).sum(0)
        elif multitask.mode == "pcgrad":
            direction = _pcgrad(combined)
        else:
            direction = _cagrad(combined, multitask.cagrad_c, multitask.cagrad_rescale)
        if multitask.reward_only:
            direction = direction + torch.stack(list(self.regulariser_grads.values())).sum(0)
        return direction


def stop_tokens(tokenizer, model: torch.nn.Module, extra: Sequence[str], template_kwargs: dict) -> set[int]:
    """eos, the model's generation eos ids, the extra stop tokens, and the special token the template
    writes right after an assistant reply (found by rendering one)."""
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops |= {int(declared)} if isinstance(declared, int) else {int(i) for i in declared or []}
    stops |= {int(tokenizer.convert_tokens_to_ids(token)) for token in extra}
    asked = [{"role": "user", "content": "Hello."}]
    prompt = tokenizer.apply_chat_template(
        asked, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
    )
    reply = tokenizer.apply_chat_template(
        [*asked, {"role": "assistant", "content": "Fine."}],
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    specials = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    stops |= {next(int(i) for i in reply[len(prompt) :] if int(i) in specials)}
    return stops


def _advantages(rewards: list[float], group: int, scale: str) -> list[float]:
    """(r - group mean) / (group std + eps), or / (batch std + eps), or centred only; exactly 0 for a
    group whose rewards are all equal."""
    batch_std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    out = []
    for start in range(0, len(rewards), group):
        values = rewards[start : start + group]
        if max(values) == min(values):
            out += [0.0] * group
            continue
        mean = statistics.fmean(values)
        divisor = {
            "group": statistics.stdev(values) + ADVANTAGE_EPS,
            "batch": batch_std + ADVANTAGE_EPS,
            "none": 1.0,
        }[scale]
        out += [(value - mean) / divisor for value in values]
    return out


def _score(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [len] of ``completion`` after ``prompt``, one row alone, fp32 forward."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    with torch.autocast(device_type=device.type, enabled=False):
        logits = model(input_ids=ids).logits[0].float()
    scaled = logits[len(prompt) - 1 : len(prompt) + len(completion) - 1].double() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    chosen = logp.gather(-1, torch.tensor(completion, device=device)[:, None]).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


def _aggregate(values: list[torch.Tensor], loss_type: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token values of each row -> the loss type's scalar (rows of one task)."""
    if loss_type == "grpo":
        return torch.stack([v.sum() / max(len(v), 1) for v in values]).mean()
    total = torch.stack([v.sum() for v in values]).sum()
    if loss_type == "dr_grpo":
        return total / (len(values) * max_new_tokens)
    return total / max(sum(len(v) for v in values), 1)


def _pcgrad(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient projected off every OTHER original gradient it conflicts with, in order; summed."""
    out = []
    for i, g in enumerate(grads):
        projected = g.clone()
        for j, other in enumerate(grads):
            norm2 = float(other @ other)
            if i != j and norm2 > 0 and float(projected @ other) < 0:
                projected = projected - float(projected @ other) / norm2 * other
        out.append(projected)
    return torch.stack(out).sum(0)


def _cagrad(grads: list[torch.Tensor], c: float, rescale: int) -> torch.Tensor:
    """CAGrad (arXiv 2110.14048) for one or two tasks: the dual minimised over w = (a, 1 - a) by golden
    section, then d = g0 + c ||g0|| g_w / ||g_w||, rescaled."""
    g = torch.stack(grads).double()
    g0 = g.mean(0)
    if len(grads) == 1:
        weights = torch.ones(1, dtype=torch.float64)
    else:
        gram = g @ g.T
        scale = float(gram.diagonal().mean())
        gram = gram / scale if scale > 0 else gram
        b = torch.full((2,), 0.5, dtype=torch.float64)
        radius = c * math.sqrt(max(float(b @ gram @ b), 0.0))

        def dual(a: float) -> float:
            w = torch.tensor([a, 1 - a], dtype=torch.float64)
            return float(w @ gram @ b) + radius * math.sqrt(max(float(w @ gram @ w), 0.0))

        low, high = 0.0, 1.0
        for _ in range(200):
            left, right = low + (high - low) * 0.382, low + (high - low) * 0.618
            low, high = (low, right) if dual(left) < dual(right) else (left, high)
        weights = torch.tensor([low, 1 - low], dtype=torch.float64)
    gw = weights @ g
    d = g0 + c * float(g0.norm()) / float(gw.norm()) * gw if float(gw.norm()) > 0 else g0
    return (d / (1.0, 1.0 + c * c, 1.0 + c)[rescale]).float()


def reference_step(
    cfg: Config,
    policy: torch.nn.Module,
    sft: torch.nn.Module,
    tokenizer,
    records: list[dict],
    sequences: torch.Tensor,
    prompt_width: int | None = None,
) -> ReferenceStep:
    """The step of ``cfg`` on ``records`` whose ``group_size`` completions each the decode loop returned
    as ``sequences`` [N, W] (prompts left-padded to ``prompt_width`` columns, by default the widest of
    them: groups dynamic sampling kept from a batch of wider prompts keep that batch's padding, then the
    generated tokens); the policy is scored at its current weights, the reference is ``sft`` (a fresh load
    of the SFT weights)."""
    grpo, kwargs, group = cfg.grpo, dict(cfg.model.chat_template_kwargs), cfg.grpo.group_size
    prompts = _rendered(cfg, tokenizer, records)
    width = max(len(p) for p in prompts) if prompt_width is None else prompt_width
    stops = stop_tokens(tokenizer, policy, cfg.model.extra_stop_tokens, kwargs)
    completions = []
    for row in sequences[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row) - 1)
        completions.append(row[: end + 1])
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    rows = [records[i // group] for i in range(len(prompts))]
    rewards = [
        weighted_reward(r["task"], t, r, cfg.rewards) for t, r in zip(texts, rows, strict=True)
    ]
    advantages = _advantages(rewards, group, grpo.loss.scale_rewards)

    temperature = grpo.sampling.temperature
    scored = [_score(policy, p, c, temperature) for p, c in zip(prompts, completions, strict=True)]
    with torch.no_grad():
        ref = [_score(sft, p, c, temperature)[0] for p, c in zip(prompts, completions, strict=True)]
    loss = grpo.loss
    params = [p for p in policy.parameters() if p.requires_grad]
    policy_grads, regulariser_grads, entropy_grads, task_losses = {}, {}, {}, {}
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:  # the tasks' fixed order (PCGrad's)
        idx = [i for i, r in enumerate(rows) if r["task"] == task]
        policy_terms, kls, entropies = [], [], []
        for i in idx:
            logp, entropy = scored[i]
            ratio = torch.exp(logp - logp.detach())  # the first update: old == new
            advantage = advantages[i]
            clipped = torch.clamp(ratio, 1 - loss.epsilon_low, 1 + loss.epsilon_high)
            policy_terms.append(-torch.minimum(ratio * advantage, clipped * advantage))
            delta = ref[i] - logp
            kls.append(torch.exp(delta) - delta - 1)
            entropies.append(entropy)
        n_max = grpo.sampling.max_new_tokens
        policy_loss = _aggregate(policy_terms, loss.loss_type, n_max)
        regulariser = loss.beta * _aggregate(kls, loss.loss_type, n_max) - loss.entropy_coef * _aggregate(
            entropies, loss.loss_type, n_max
        )
        task_losses[task] = float((policy_loss + regulariser).detach())
        bonus = -loss.entropy_coef * _aggregate(entropies, loss.loss_type, n_max)
        policy_grads[task], regulariser_grads[task], entropy_grads[task] = (
            _flat_grad(term, params) for term in (policy_loss, regulariser, bonus)
        )
    tokens = sum(len(c) for c in completions)
    with torch.no_grad():
        kl = sum(
            float((torch.exp(r - s[0]) - (r - s[0]) - 1).sum()) for r, s in zip(ref, scored, strict=True)
        )
        entropy = sum(float(s[1].sum()) for s in scored)
    return ReferenceStep(
        prompts,
        completions,
        texts,
        rewards,
        advantages,
        [s[0].detach() for s in scored],
        ref,
        [s[1].detach() for s in scored],
        task_losses,
        kl / tokens,
        entropy / tokens,
        policy_grads,
        regulariser_grads,
        entropy_grads,
    )


def _rendered(cfg: Config, tokenizer, records: list[dict]) -> list[list[int]]:
    """Each row's prompt ids, rendered by the template itself (row ``i`` answers ``records[i // G]``)."""
    kwargs, group = dict(cfg.model.chat_template_kwargs), cfg.grpo.group_size
    rendered = [
        tokenizer.apply_chat_template(
            example_messages(r), add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        for r in records
    ]
    return [list(map(int, rendered[i // group])) for i in range(len(records) * group)]


def _greedy_choice(logits: torch.Tensor, earlier: list[int], stops: set[int], column: int, cfg: Config) -> torch.Tensor:
    """The logits [V] greedy decoding picks from at completion position ``column``: the presence and frequency
    penalties over the row's ``earlier`` tokens, and the stop tokens at -inf before ``min_new_tokens``."""
    sampling = cfg.grpo.sampling
    counts = torch.bincount(torch.tensor(earlier, dtype=torch.long), minlength=logits.shape[-1]).to(logits)
    z = logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(logits)
    if column < sampling.min_new_tokens:
        z[sorted(stops)] = -math.inf
    return z


def greedy_problems(
    cfg: Config, policy: torch.nn.Module, tokenizer, records: list[dict], sequences: torch.Tensor
) -> list[str]:
    """Rows of a greedy decode ``sequences`` [N, W] (prompts left-padded to the widest, then the generated
    tokens) that are not the greedy decode of their prompt alone: each row is run alone, no cache, fp32, and
    at every position its token must be the argmax of the logits after the rollout's processors (written
    out here: ``_greedy_choice``), up to ties within ``TIE_BOUND``; a row ends at its first stop token, or
    runs to ``max_new_tokens``."""
    prompts, kwargs = _rendered(cfg, tokenizer, records), dict(cfg.model.chat_template_kwargs)
    stops = stop_tokens(tokenizer, policy, cfg.model.extra_stop_tokens, kwargs)
    width, device, problems = max(len(p) for p in prompts), next(policy.parameters()).device, []
    for i, row in enumerate(sequences[:, width:].tolist()):
        end = next((k for k, token in enumerate(row) if token in stops), None)
        completion = row if end is None else row[: end + 1]
        if end is None and len(row) < cfg.grpo.sampling.max_new_tokens:
            problems.append(f"row {i} ends after {len(row)} tokens without a stop token")
            continue
        ids = torch.tensor([prompts[i] + completion], device=device)
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            logits = policy(input_ids=ids).logits[0, len(prompts[i]) - 1 : -1].float()  # [len, V]
        for k, token in enumerate(completion):
            z = _greedy_choice(logits[k], completion[:k], stops, k, cfg)
            best = int(z.argmax())
            if token != best and float(z[best] - z[token]) > TIE_BOUND:
                problems.append(f"row {i}, token {k}: decoded {token}, its prompt alone gives {best}")
                break
    return problems


def _flat_grad(term: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """d term / d params as one fp32 vector [P] (0 for weights the term does not reach)."""
    if not term.requires_grad:
        return torch.cat([torch.zeros(p.numel(), device=p.device) for p in params])
    pieces = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1).float()
            for g, p in zip(pieces, params, strict=True)
        ]
    )
