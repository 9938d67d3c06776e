"""How a rollout samples, the library's way: ``model.generate`` with the project's processors and stop ids.

This is the reference the fast decode loop (``grpo/model/fast/decode.py``) stands in for, and what runs
under ``model.fast_paths: off``: read it to learn how we sample. ``generate`` gets a complete
``GenerationConfig`` and ``use_model_defaults=False``, so a checkpoint's own defaults (a repetition
penalty, ``top_k: 50``, another temperature) can never change the distribution the scorer assumes (I10).
Per generated column it takes the last position's logits in fp32, applies the caller's completion-only
processors (penalties, EOS suppression: ``sampling.build_logits_processors``, I6), then temperature,
top-k and top-p, and draws with ``torch.multinomial`` on the global generator (argmax when greedy); after
a row's first stop token it writes the pad id, and it ends when every row has stopped or
``max_new_tokens`` are out.

Asked for it, a sampled decode keeps what it computed for each token it drew (``SamplerRecord``, one
``record_draw`` per column): the id, its log-prob under the distribution it was drawn from and under
``softmax(z / T)`` of the same logits (the scorer's distribution, I10), whether a processor changed a logit
it kept there (a penalty: more than masking tokens out), and the largest scaled logit (what a precision
bound scales with). The step holds the scorer to it (``grpo/train/agreement.py``). Here ``generate``'s own
``output_logits`` and ``output_scores`` give those numbers; the decode loop takes them from the scores it drew
from, the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from grpo.config import SamplingConfig
from grpo.core.logprobs import entropy_from_logits


class SamplerRecord(NamedTuple):
    """What a sampled decode computed for each token it drew: [N, C] each; pad, 0 and False after a row's
    stop token (no draw there)."""

    ids: torch.Tensor  # long: the id drawn at each position
    logprobs: torch.Tensor  # fp32: its log-prob under the distribution it was drawn from (every processor)
    scored: torch.Tensor  # fp32: its log-prob under softmax(z / T) of the same logits: what the scorer computes
    reshaped: torch.Tensor  # bool: a processor changed a logit it kept there (a penalty), not only masked
    scale: torch.Tensor  # fp32: the largest |z / T| there (a precision bound scales with it)

    def rows(self, index: torch.Tensor) -> SamplerRecord:
        """The rows ``index`` [n] of every tensor."""
        return SamplerRecord(*(t[index] for t in self))

    def padded(self, width: int, pad_id: int) -> SamplerRecord:
        """Every tensor right-padded to ``width`` columns as after a stop token (the completions' padding)."""
        extra = width - self.ids.shape[1]
        fills = (pad_id, 0.0, 0.0, False, 0.0)
        return SamplerRecord(*(torch.nn.functional.pad(t, (0, extra), value=v) for t, v in zip(self, fills, strict=True)))


def record_draw(
    logits: torch.Tensor,  # [N, V] fp32 raw logits of the column
    scores: torch.Tensor,  # [N, V] what the tokens were drawn from: after the processors, temperature, top-k, top-p
    tokens: torch.Tensor,  # [N] the drawn ids
    running: torch.Tensor,  # [N] bool: the row had not stopped before this column
    temperature: float,
    pad_id: int,
) -> SamplerRecord:
    """One column of a ``SamplerRecord`` ([N] each). The scaled logits ``z / T`` are the temperature warper's
    own division, so where no processor acted ``scores`` is exactly them; top-k, top-p and EOS suppression
    only set logits to -inf, which changes the drawn log-prob but no kept logit; a penalty changes kept
    logits (``reshaped``)."""
    plain = logits / temperature  # [N, V] softmax(z / T): the scorer's distribution (I10)
    chosen = tokens[:, None]
    drawn = scores.gather(-1, chosen)[:, 0] - scores.logsumexp(-1)
    scored = plain.gather(-1, chosen)[:, 0] - plain.logsumexp(-1)
    reshaped = ((scores != plain) & torch.isfinite(scores)).any(-1)
    scale = plain.abs().amax(-1)
    return SamplerRecord(
        torch.where(running, tokens, pad_id),
        torch.where(running, drawn, 0.0),
        torch.where(running, scored, 0.0),
        reshaped & running,
        torch.where(running, scale, 0.0),
    )


def stack_records(columns: Sequence[SamplerRecord]) -> SamplerRecord:
    """Columns ([N] each) -> the record [N, C] (on the CPU, where the rollout keeps its tensors)."""
    return SamplerRecord(*(torch.stack(parts, dim=1).cpu() for parts in zip(*columns, strict=True)))


def generation_config(
    sampling: SamplingConfig, eos_ids: Sequence[int], pad_id: int, greedy: bool = False
) -> GenerationConfig:
    """The complete config ``generate`` samples by: ``sampling``'s temperature, top-p, top-k and length,
    the stop ids, the pad id; ``greedy``: argmax decoding with the same stop ids and length."""
    return GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=None if greedy else sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
    )


@torch.no_grad()
def generate_sequences(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [N, P] left-padded prompts
    attention_mask: torch.Tensor,  # [N, P] 1 = real token
    sampling: SamplingConfig,
    eos_ids: Sequence[int],
    pad_id: int,
    processors: LogitsProcessorList,  # completion-only processors (``sampling.build_logits_processors``)
    greedy: bool = False,
    past_key_values=None,  # a cache of every prompt column but the last (``prefix.prefilled_cache``)
    entropy: list[torch.Tensor] | None = None,
    record: list[SamplerRecord] | None = None,
) -> torch.Tensor:
    """Sequences ``[N, P + C]``: the prompts, then the completions, the pad id after a row's first stop
    token; ``C`` is the longest completion (at most ``max_new_tokens``).

    ``entropy``, when given, receives one ``[N]`` tensor per generated column: the entropy of
    ``softmax(z / sampling.temperature)`` of the fp32 logits that column's tokens were drawn from (as
    ``score_completions`` defines it: the processors change which tokens are drawn, not the scored
    distribution); 0 for a row that had stopped before it. ``record``, when given (sampling only), receives
    one ``record_draw`` per generated column, from ``generate``'s raw logits and the scores it drew from."""
    measure = entropy is not None or (record is not None and not greedy)
    cache = {} if past_key_values is None else {"past_key_values": past_key_values}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config(sampling, eos_ids, pad_id, greedy),
        logits_processor=processors,
        use_model_defaults=False,
        return_dict_in_generate=measure,
        output_logits=measure,
        output_scores=measure and record is not None,
        **cache,
    )
    if not measure:
        return out
    generated = out.sequences[:, input_ids.shape[1] :]  # [N, C]
    stopped = torch.isin(generated, torch.as_tensor(list(eos_ids), device=generated.device)).int()
    running = (stopped.cumsum(dim=1) - stopped) == 0  # [N, C] no stop token before this column
    for column, logits in enumerate(out.logits):  # [N, V] fp32, before any processor
        if entropy is not None:
            entropy.append(torch.where(running[:, column], entropy_from_logits(logits / sampling.temperature), 0.0))
        if record is not None and not greedy:
            record.append(
                record_draw(logits, out.scores[column], generated[:, column], running[:, column],
                            sampling.temperature, pad_id)
            )
    return out.sequences
