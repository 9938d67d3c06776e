"""Logits processors for rollout that look at completion tokens only (I6).

The decode loop (``decode.py``, as ``generate()``) hands a processor the prompt and the tokens generated so far, ``[B, P + t]``; the
processors here slice off the first ``prompt_width`` columns before counting anything, so words of
the prompt are never penalised and a long prompt never counts as "enough tokens" for EOS.
Temperature, top-p and top-k are sampling settings, not processors here: the scorer must apply the
same temperature (I10), and the decode loop runs those warpers after these processors, as HF does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from grpo.config import SamplingConfig
from grpo.errors import GrpoError


class SamplingError(GrpoError, ValueError):
    """A logits processor was called with inputs that do not match how it was built."""


def _completion(input_ids: torch.Tensor, prompt_width: int, name: str) -> torch.Tensor:
    """input_ids: [B, P + t] -> completion so far: [B, t]."""
    if input_ids.shape[1] < prompt_width:
        raise SamplingError(
            f"{name}: input_ids has {input_ids.shape[1]} columns, fewer than the prompt width "
            f"{prompt_width}; build the processors with prompt_width = the padded prompt batch's width"
        )
    return input_ids[:, prompt_width:]


class EosSuppressor(LogitsProcessor):
    """Sets eos logits to -inf while the completion has fewer than ``min_new_tokens`` tokens.

    It only ever lowers eos logits (never boosts another token). ``fired`` counts row-steps where it
    applied; ``fired_on_top`` those where an eos token was the argmax before suppression, i.e. where
    the model wanted to stop: ``suppressed_frac()`` is the ``eos_suppressed_frac`` metric.
    """

    def __init__(self, prompt_width: int, eos_ids: Sequence[int], min_new_tokens: int) -> None:
        if not len(eos_ids):
            raise SamplingError("EosSuppressor: eos_ids is empty; pass chat.end_of_turn_ids(tokenizer)")
        self.prompt_width = prompt_width
        self.eos_ids = [int(i) for i in eos_ids]
        self.min_new_tokens = min_new_tokens
        self.reset()

    def reset(self) -> None:
        """Zero the counters (call once per rollout batch)."""
        self.fired = 0
        self.fired_on_top = 0

    def suppressed_frac(self) -> float:
        """Fraction of suppressed row-steps where eos was the top token (0.0 when it never fired)."""
        return self.fired_on_top / max(self.fired, 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, P + t], scores: [B, V] -> scores: [B, V]."""
        steps = _completion(input_ids, self.prompt_width, "EosSuppressor").shape[1]
        if steps >= self.min_new_tokens:
            return scores
        eos = torch.as_tensor(self.eos_ids, device=scores.device)
        top = scores.argmax(dim=-1)  # [B]
        self.fired += scores.shape[0]
        self.fired_on_top += int(torch.isin(top, eos).sum())
        scores = scores.clone()
        scores[:, eos] = -float("inf")
        return scores


class CompletionPenalty(LogitsProcessor):
    """OpenAI-style penalties over completion tokens only.

    ``logits -= frequency_penalty * count + presence_penalty * (count > 0)``, where ``count`` is how
    often a token occurs in this row's completion so far (the prompt is never counted).
    """

    def __init__(self, prompt_width: int, presence_penalty: float, frequency_penalty: float) -> None:
        self.prompt_width = prompt_width
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, P + t], scores: [B, V] -> scores: [B, V]."""
        completion = _completion(input_ids, self.prompt_width, "CompletionPenalty")  # [B, t]
        counts = torch.zeros_like(scores)  # [B, V]
        counts.scatter_add_(1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return (
            scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(scores.dtype)
        )


def build_logits_processors(
    prompt_width: int, eos_ids: Sequence[int], sampling_cfg: SamplingConfig
) -> tuple[LogitsProcessorList, EosSuppressor]:
    """The rollout's processors (penalties, then EOS suppression) and the suppressor for its metric.

    prompt_width: the padded prompt batch's width P (``input_ids.shape[1]`` given to the decode loop).
    """
    suppressor = EosSuppressor(prompt_width, eos_ids, sampling_cfg.min_new_tokens)
    processors = LogitsProcessorList()
    if sampling_cfg.presence_penalty or sampling_cfg.frequency_penalty:
        processors.append(
            CompletionPenalty(prompt_width, sampling_cfg.presence_penalty, sampling_cfg.frequency_penalty)
        )
    # Last, so fired_on_top judges the penalised logits the sampler would otherwise have used.
    processors.append(suppressor)
    return processors, suppressor
