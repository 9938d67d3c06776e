"""Rollouts: G completions per prompt, sampled by ``model.generate`` with the project's processors and stop
ids (``generation.py``), or by its fast stand-in where ``model.fast_paths`` allows (``FastPaths.decode``:
the same tokens), as token ids (I3, I4, I5, I6).

The engine knows token ids only. Prompts arrive as ids from the one renderer, are left-padded, and
the completions are cut at the absolute prompt width; the completion mask comes from positions up to
and including the first stop token. Decoded texts are for the rewards, never fed back to the model.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import SamplingConfig
from grpo.core.advantages import group_rows, per_row
from grpo.core.batching import PaddedBatch, completion_ids_from_generated, completion_mask, left_pad
from grpo.core.prefix import PromptPrefill, decode_cache, keep_prefills, prefilled_cache
from grpo.errors import GrpoError
from grpo.model.chat import end_of_turn_ids
from grpo.model.fast import FastPaths, PromptPass
from grpo.model.generation import SamplerRecord, stack_records
from grpo.model.precision import cast_frozen_weights_once
from grpo.model.sampling import EosSuppressor, build_logits_processors


class RolloutError(GrpoError, ValueError):
    """Rollouts that cannot be combined; the message names the values and the fix."""


@dataclass(frozen=True)
class Rollout:
    """One rollout batch; row ``i`` belongs to prompt ``i // group_size``."""

    prompt_ids: torch.Tensor  # [N, P] left-padded, N = n_prompts * G
    prompt_mask: torch.Tensor  # [N, P] 1 = real prompt token
    sequences: (
        torch.Tensor
    )  # [N, P + C] what the decode loop returned: the prompts, then every generated token
    completion_ids: torch.Tensor  # [N, C] exactly as generated
    completion_mask: torch.Tensor  # [N, C] bool, up to and including the first stop token
    texts: list[str]  # [N] decoded completions without special tokens (what rewards read)
    raw_texts: list[str]  # [N] decoded with special tokens (what the boundary monitor reads)
    lengths: torch.Tensor  # [N] tokens in the completion mask
    truncated: torch.Tensor  # [N] bool, no stop token within max_new_tokens
    eos_suppressed_frac: float  # share of suppressed steps where a stop token was the argmax
    group_size: int
    temperature: float  # the temperature the completions were sampled at: scoring divides by it (I10)
    processors: tuple[str, ...]  # what else shaped sampling but is not scored (``sampling_processors``)
    entropy: torch.Tensor | None = None  # [N, C] fp32 entropy of softmax(z / T) at each generated token,
    # from the decode loop's own logits, 0 outside the completion mask; only where asked (``with_entropy``)
    sampler: SamplerRecord | None = None  # [N, C] each: what the decode computed for each token it drew
    # (``generation.SamplerRecord``); only where asked (``with_sampler``), which the trainer's engine does


def stop_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, extra_tokens: Sequence[str] = ()
) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and end-of-turn tokens, the extra tokens
    from params, and the model's own generation eos ids (Qwen lists <|endoftext|> there)."""
    ids = end_of_turn_ids(tokenizer, extra_tokens)
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for idx in [own] if isinstance(own, int) else own or []:
        if idx not in ids:
            ids.append(idx)
    return ids


def sampling_processors(sampling: SamplingConfig) -> tuple[str, ...]:
    """The parts of the sampling distribution the scorer does not reproduce (I10 holds only in part).

    Scoring computes ``log softmax(z / T)``; top-p, top-k, EOS suppression and the penalties change
    which tokens are drawn but not that scored distribution, so the ratio and KL then describe a
    policy slightly different from the one that acted. Empty when sampling is plain ``softmax(z / T)``.
    """
    active = {
        f"top_p={sampling.top_p}": sampling.top_p < 1.0,
        f"top_k={sampling.top_k}": sampling.top_k > 0,
        f"min_new_tokens={sampling.min_new_tokens}": sampling.min_new_tokens > 0,
        f"presence_penalty={sampling.presence_penalty}": sampling.presence_penalty != 0,
        f"frequency_penalty={sampling.frequency_penalty}": sampling.frequency_penalty != 0,
    }
    return tuple(name for name, on in active.items() if on)


@torch.no_grad()
def generate_rollout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    group_size: int,
    sampling: SamplingConfig,
    eos_ids: Sequence[int],
    seed: int,
    greedy: bool = False,
    shared_prefill: bool = False,
    with_entropy: bool = False,
    prompt_pass: PromptPass | None = None,
    *,
    fast: FastPaths,
) -> Rollout:
    """Sample ``group_size`` completions for every prompt (ids from ``chat.render_prompt``).

    ``greedy``: argmax decoding instead of sampling (evaluation), through the same stop ids,
    completion-only penalties, EOS suppression and masks (I4-I6). ``shared_prefill``: each prompt is
    prefilled once and its key/value cache repeated G times (``prefix.prefilled_cache``); the logits,
    hence the sampled tokens, are those of a plain prefill. ``with_entropy``: the rollout carries each
    token's entropy under the sampling temperature (``Rollout.entropy``), taken from the logits that
    drew it, so no scoring pass is needed for it. ``prompt_pass``: a pass over these prompts shared by two
    calls (``fast.prompt_pass()``): a call without ``shared_prefill`` keeps its pass over the whole prompts,
    a later call with it starts from that pass where the numbers are those of its own prefill. ``fast``: the
    run's fast paths (``model.fast_paths``), which say how to decode.
    """
    return sample_rollout(
        model,
        tokenizer,
        prompts,
        group_size,
        sampling,
        eos_ids,
        seed,
        greedy,
        shared_prefill,
        with_entropy=with_entropy,
        prompt_pass=prompt_pass,
        fast=fast,
    )[0]


@torch.no_grad()
def sample_rollout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    group_size: int,
    sampling: SamplingConfig,
    eos_ids: Sequence[int],
    seed: int,
    greedy: bool = False,
    shared_prefill: bool = False,
    segments: Sequence[Hashable] | None = None,
    with_entropy: bool = False,
    prompt_pass: PromptPass | None = None,
    *,
    fast: FastPaths,
    with_sampler: bool = False,
    keep_prefill: bool = False,
) -> tuple[Rollout, tuple[PromptPrefill, ...]]:
    """``generate_rollout``; with ``segments`` (a label per prompt, e.g. its task) the shared prefill runs
    one pass per label over the whole prompts (``prefix.prefilled_cache``), and ``keep_prefill`` keeps those
    passes with their graph (``prefix.keep_prefills``) for the update's policy pass to reuse: the same
    weights on the same prompts, so running them again would repeat the work. Kept or not, the decode
    starts from the same passes: a bf16 matrix product's rounding depends on its shape, so keeping the
    graph must not change which passes run, or the kept prefill would sample other tokens than the plain
    one.
    ``with_sampler``: the rollout carries what the decode computed for each token it drew
    (``Rollout.sampler``), for the step to hold the scorer to it (sampling only)."""
    repeated = per_row([list(p) for p in prompts], group_size)
    prompt = left_pad(repeated, tokenizer.pad_token_id)
    device = next(model.parameters()).device
    cache, kept = {}, ()
    prompt_width = prompt.input_ids.shape[1]
    processors, suppressor = build_logits_processors(prompt_width, eos_ids, sampling)
    was_training = model.training
    model.eval()
    distinct = prompt.input_ids[::group_size].to(device), prompt.attention_mask[::group_size].to(device)
    if shared_prefill and keep_prefill and segments is not None and prompt_width > 1:
        # Outside ``cast_frozen_weights_once``: it marks the frozen weights as requiring grad.
        with torch.enable_grad():  # kept with its graph: the update's backward runs through it
            kept = keep_prefills(model, *distinct, segments)
        cache = {"past_key_values": decode_cache(model, kept, group_size)}
    # The seed is an argument: sampling never depends on (or moves) the global generator.
    devices = [device] if device.type == "cuda" else []
    # A bf16 CPU decode casts each weight once, not at every token (``cast_frozen_weights_once``).
    with torch.random.fork_rng(devices=devices), cast_frozen_weights_once(model):
        torch.manual_seed(seed)
        if shared_prefill and not cache and prompt_width > 1:
            if segments is not None:  # the passes a kept prefill runs (``prefix.prefilled_cache``)
                prefilled = prefilled_cache(model, *distinct, group_size, segments)
            else:
                reused = None if prompt_pass is None else prompt_pass.prefilled(model, *distinct, group_size)
                prefilled = reused if reused is not None else prefilled_cache(model, *distinct, group_size)
            cache = {"past_key_values": prefilled}
        entropy = [] if with_entropy else None
        record = [] if with_sampler and not greedy else None
        sequences = fast.decode(
            model,
            prompt.input_ids.to(device),
            prompt.attention_mask.to(device),
            sampling,
            eos_ids,
            tokenizer.pad_token_id,
            processors,
            greedy=greedy,
            entropy=entropy,
            prompt_pass=None if shared_prefill else prompt_pass,
            record=record,
            **cache,
        )
    model.train(was_training)
    measured = torch.stack(entropy, dim=1) if with_entropy else None  # [N, C]
    drawn = stack_records(record) if record else None
    return rollout_from_sequences(
        tokenizer, prompt, sequences, eos_ids, suppressor, group_size, sampling, entropy=measured, sampler=drawn
    ), kept


def rollout_from_sequences(
    tokenizer: PreTrainedTokenizerBase,
    prompt: PaddedBatch,  # [N, P] the left-padded prompts given to the decode loop
    sequences: torch.Tensor,  # [N, P + C] the decode loop's output
    eos_ids: Sequence[int],
    suppressor: EosSuppressor,
    group_size: int,
    sampling: SamplingConfig,  # what sampled ``sequences``: recorded on the rollout for scoring (I10)
    entropy: torch.Tensor | None = None,  # [N, C] the decode loop's entropy per generated token, if measured
    sampler: SamplerRecord | None = None,  # [N, C] what the decode computed for each drawn token, if recorded
) -> Rollout:
    """Cut the completions at the absolute prompt width (I4), mask them by position (I5), decode them."""
    completion_ids = completion_ids_from_generated(sequences.cpu(), prompt.input_ids.shape[1])
    masks = completion_mask(completion_ids, eos_ids)
    kept = [ids[: int(n)].tolist() for ids, n in zip(completion_ids, masks.lengths, strict=True)]
    return Rollout(
        prompt_ids=prompt.input_ids,
        prompt_mask=prompt.attention_mask,
        sequences=sequences.cpu(),
        completion_ids=completion_ids,
        completion_mask=masks.mask,
        texts=tokenizer.batch_decode(kept, skip_special_tokens=True),
        raw_texts=tokenizer.batch_decode(kept, skip_special_tokens=False),
        lengths=masks.lengths,
        truncated=masks.truncated,
        eos_suppressed_frac=suppressor.suppressed_frac(),
        group_size=group_size,
        temperature=sampling.temperature,
        processors=sampling_processors(sampling),
        entropy=None if entropy is None else entropy.cpu(),
        sampler=sampler,
    )


def select_groups(rollout: Rollout, groups: Sequence[int]) -> Rollout:
    """The rows of the given prompt groups, in that order (for dynamic sampling)."""
    g = rollout.group_size
    index = group_rows(groups, g)
    rows = index.tolist()
    return Rollout(
        prompt_ids=rollout.prompt_ids[index],
        prompt_mask=rollout.prompt_mask[index],
        sequences=rollout.sequences[index],
        completion_ids=rollout.completion_ids[index],
        completion_mask=rollout.completion_mask[index],
        texts=[rollout.texts[r] for r in rows],
        raw_texts=[rollout.raw_texts[r] for r in rows],
        lengths=rollout.lengths[index],
        truncated=rollout.truncated[index],
        eos_suppressed_frac=rollout.eos_suppressed_frac,
        group_size=g,
        temperature=rollout.temperature,
        processors=rollout.processors,
        entropy=None if rollout.entropy is None else rollout.entropy[index],
        sampler=None if rollout.sampler is None else rollout.sampler.rows(index),
    )


def _pad_to(tensor: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
    """[N, W] -> [N, width], padding on the left (prompts) or the right (completions)."""
    pad = torch.full((tensor.shape[0], width - tensor.shape[1]), value, dtype=tensor.dtype)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts stay left-padded, completions right-padded, and
    the masks (not the pad id) say which positions are real, so pad == eos stays harmless (I5)."""
    distributions = {(r.temperature, r.processors) for r in rollouts}
    if len(distributions) > 1:
        raise RolloutError(
            f"concat_rollouts: rollouts sampled from different distributions {sorted(distributions)} cannot "
            "share one scoring temperature; sample every part with the same grpo.sampling"
        )
    p = max(r.prompt_ids.shape[1] for r in rollouts)
    c = max(r.completion_ids.shape[1] for r in rollouts)
    cat = torch.cat
    weights = [len(r.texts) for r in rollouts]
    return Rollout(
        prompt_ids=cat([_pad_to(r.prompt_ids, p, pad_id, left=True) for r in rollouts]),
        prompt_mask=cat([_pad_to(r.prompt_mask, p, 0, left=True) for r in rollouts]),
        # Each part's decode output split at its own prompt width, padded as the prompts and completions are.
        sequences=cat(
            [
                torch.cat(
                    [
                        _pad_to(r.sequences[:, : r.prompt_ids.shape[1]], p, pad_id, left=True),
                        _pad_to(r.sequences[:, r.prompt_ids.shape[1] :], c, pad_id, left=False),
                    ],
                    dim=1,
                )
                for r in rollouts
            ]
        ),
        completion_ids=cat([_pad_to(r.completion_ids, c, pad_id, left=False) for r in rollouts]),
        completion_mask=cat([_pad_to(r.completion_mask, c, False, left=False) for r in rollouts]),
        texts=[t for r in rollouts for t in r.texts],
        raw_texts=[t for r in rollouts for t in r.raw_texts],
        lengths=cat([r.lengths for r in rollouts]),
        truncated=cat([r.truncated for r in rollouts]),
        eos_suppressed_frac=sum(r.eos_suppressed_frac * w for r, w in zip(rollouts, weights, strict=True))
        / max(sum(weights), 1),
        group_size=rollouts[0].group_size,
        temperature=rollouts[0].temperature,
        processors=rollouts[0].processors,
        entropy=None
        if any(r.entropy is None for r in rollouts)
        else cat([_pad_to(r.entropy, c, 0, left=False) for r in rollouts]),
        sampler=None
        if any(r.sampler is None for r in rollouts)
        else SamplerRecord(*map(cat, zip(*(r.sampler.padded(c, pad_id) for r in rollouts), strict=True))),
    )
