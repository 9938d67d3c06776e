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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from grpo.config import SamplingConfig
from grpo.core.logprobs import entropy_from_logits


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
) -> torch.Tensor:
    """Sequences ``[N, P + C]``: the prompts, then the completions, the pad id after a row's first stop
    token; ``C`` is the longest completion (at most ``max_new_tokens``).

    ``entropy``, when given, receives one ``[N]`` tensor per generated column: the entropy of
    ``softmax(z / sampling.temperature)`` of the fp32 logits that column's tokens were drawn from (as
    ``score_completions`` defines it: the processors change which tokens are drawn, not the scored
    distribution); 0 for a row that had stopped before it."""
    measure = entropy is not None
    cache = {} if past_key_values is None else {"past_key_values": past_key_values}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config(sampling, eos_ids, pad_id, greedy),
        logits_processor=processors,
        use_model_defaults=False,
        return_dict_in_generate=measure,
        output_logits=measure,
        **cache,
    )
    if not measure:
        return out
    generated = out.sequences[:, input_ids.shape[1] :]  # [N, C]
    stopped = torch.isin(generated, torch.as_tensor(list(eos_ids), device=generated.device)).int()
    running = (stopped.cumsum(dim=1) - stopped) == 0  # [N, C] no stop token before this column
    for column, logits in enumerate(out.logits):  # [N, V] fp32, before any processor
        entropy.append(torch.where(running[:, column], entropy_from_logits(logits / sampling.temperature), 0.0))
    return out.sequences
