"""The decode loop: what ``model.generate`` does for a rollout (``grpo/model/generation.py``), without its
per-token overhead.

``generate`` spends much of a small model's decode step outside the model: it rebuilds the 4D attention
mask from the 2D one at every token, re-derives the inputs, checks stopping criteria objects. This loop
runs the same computation with the mask prepared once per step by two tensor ops (``core.attention``),
and is otherwise ``generate``'s sampling loop, step for step: the logits of the last position in fp32,
the caller's processors then temperature, top-k and top-p (the order ``generate`` applies them),
``softmax`` and ``torch.multinomial``'s draw on the global generator (``multinomial.multinomial_one``: the same
draws without its serial loop) or argmax, the pad id after a row's stop token, and the loop ends when every row
has stopped or ``max_new_tokens`` are out. The key/value cache writes each token into room reserved once
(``ReservedLayer``) where ``generate``'s concatenates the whole cache again. After the first step, a
Llama-family model on a CPU runs its one-token steps through ``lean_step.LeanStep``: the forward's very
operations without the module and adapter machinery around them, checked against the model's own
forward at its first step; on a GPU they replay a CUDA graph of the model's own forward over a static
cache (``graph_step.GraphStep``), checked against the model's own forward at its first step too. Same
generator, same draws: the tokens are those of ``generate``
(``tests/test_decode.py`` compares them, sampled and greedy, with and without a prefilled cache).
Asked for it, the loop also hands back each generated token's entropy under the scorer's distribution
(``softmax(z / T)`` of the same fp32 logits, ``core.logprobs.entropy_from_logits``): evaluation's
entropy of the sampling policy without a second forward pass over the rollout.

Self-check (``loop_mismatch``, once per process): on a small random Llama model, the loop and
``generate`` sample the same tokens (warped and greedy, from left-padded prompts); where they do not (a
transformers release whose ``generate`` samples otherwise), ``FastPaths`` runs ``generate`` instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo.config import SamplingConfig
from grpo.core.attention import model_attention_mask
from grpo.core.batching import position_ids_from_mask
from grpo.core.logprobs import entropy_from_logits
from grpo.model.fast.graph_step import GraphStep
from grpo.model.fast.lean_step import LeanStep
from grpo.model.fast.multinomial import multinomial_one
from grpo.model.fast.prompt_pass import PromptPass, watch_prefix
from grpo.model.fast.warning import fall_back
from grpo.model.generation import SamplerRecord, generate_sequences, record_draw


def warpers(sampling: SamplingConfig, greedy: bool) -> LogitsProcessorList:
    """Temperature, top-k and top-p after the caller's processors, each only where ``generate`` adds
    it (temperature != 1, top_k > 0, top_p < 1); none for greedy decoding."""
    out = LogitsProcessorList()
    if greedy:
        return out
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes each step's keys and values into room reserved once, instead of
    concatenating the whole cache anew at every token (per step a copy of every layer's cache). Its keys
    and values are views of the first ``length`` positions of the reserved buffers: the same values as
    ``DynamicLayer``'s, hence the same logits."""

    reserve: int  # positions to reserve beyond the current length when (re)allocating

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        buffers = getattr(self, "_buffers", None)
        if buffers is None or buffers[0].shape[-2] < new or buffers[0].shape[:-2] != key_states.shape[:-2]:
            shape = (*key_states.shape[:-2], new + self.reserve, key_states.shape[-1])
            buffers = tuple(key_states.new_empty(shape) for _ in range(2))
            if old:
                buffers[0][..., :old, :] = self.keys
                buffers[1][..., :old, :] = self.values
            self._buffers = buffers
        buffers[0][..., old:new, :] = key_states
        buffers[1][..., old:new, :] = value_states
        self.keys, self.values = buffers[0][..., :new, :], buffers[1][..., :new, :]
        return self.keys, self.values

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on (the next ``update`` writes there again)."""
        self.keys, self.values = self._buffers[0][..., :length, :], self._buffers[1][..., :length, :]


def reserve_room(cache, tokens: int) -> None:
    """Make every ``DynamicLayer`` of ``cache`` a ``ReservedLayer`` with room for ``tokens`` more."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer:
            layer.__class__ = ReservedLayer
            layer.reserve = tokens


@torch.no_grad()
def decode(
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
    prompt_pass: PromptPass | None = None,
    record: list[SamplerRecord] | None = None,
) -> torch.Tensor:
    """Sequences ``[N, P + C]`` as ``generate`` returns them: prompt, then the completions, the pad id
    after a row's first stop token; ``C`` is the longest completion (at most ``max_new_tokens``).

    ``entropy``, when given, receives one ``[N]`` tensor per generated column: the entropy of
    ``softmax(z / sampling.temperature)`` of the logits that column's tokens were drawn from, as
    ``score_completions`` defines it (the processors and warpers change which tokens are drawn, not
    the scored distribution); 0 for a row that had stopped.

    ``prompt_pass``, when given (and no ``past_key_values``), keeps the first step's pass over the whole
    prompts and checks it (``PromptPass``). ``record``, when given (sampling only), receives one
    ``generation.record_draw`` per generated column, from the scores each token was drawn from, taken as
    drawn: before the pad id replaces a stopped row's draw."""
    rows = input_ids.shape[0]
    positions = position_ids_from_mask(attention_mask)  # [N, P]
    prefilled = 0 if past_key_values is None else input_ids.shape[1] - 1
    step_ids = input_ids[:, prefilled:]
    step_positions = positions[:, prefilled:]
    mask = attention_mask
    stops = torch.as_tensor(list(eos_ids), device=input_ids.device)
    running = torch.ones(rows, dtype=torch.bool, device=input_ids.device)
    shape = LogitsProcessorList([*processors, *warpers(sampling, greedy)])
    sequences = input_ids
    watching = prompt_pass is not None and past_key_values is None
    lean = graph = None
    for column in range(sampling.max_new_tokens):
        if column == 1:
            graph = GraphStep.build(model, past_key_values, rows, mask.shape[1] + sampling.max_new_tokens)
        step_mask = None if graph is not None else model_attention_mask(model, mask, step_ids.shape[1])
        if graph is not None:
            logits, graph = _graph_logits(model, graph, column == 1, step_ids, step_positions, mask, past_key_values)
            if graph is not None:
                past_key_values = None  # the static cache holds every column from here on
        elif column == 0:
            with watch_prefix(prompt_pass.watch) if watching else contextlib.nullcontext():
                out = _forward(model, step_ids, step_mask, step_positions, past_key_values)
            if watching:
                prompt_pass.keep(input_ids, attention_mask, out.past_key_values)
            past_key_values = out.past_key_values
            reserve_room(past_key_values, sampling.max_new_tokens)
            logits = out.logits
        else:
            if column == 1 and all(type(layer) is ReservedLayer for layer in getattr(past_key_values, "layers", [None])):
                lean = LeanStep.build(model)
            logits = _step_logits(model, lean, step_ids, step_mask, step_positions, past_key_values)
        logits = logits[:, -1, :].to(dtype=torch.float32)  # [N, V]
        if entropy is not None:
            entropy.append(torch.where(running, entropy_from_logits(logits / sampling.temperature), 0.0))
        scores = shape(sequences, logits)
        if greedy:
            tokens = scores.argmax(dim=-1)
        else:
            tokens = multinomial_one(torch.softmax(scores, dim=-1))
            if record is not None:
                record.append(record_draw(logits, scores, tokens, running, sampling.temperature, pad_id))
        tokens = torch.where(running, tokens, pad_id)  # [N]
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        running &= ~torch.isin(tokens, stops)
        if column == sampling.max_new_tokens - 1 or not bool(running.any()):
            break
        step_ids = tokens[:, None]
        step_positions = step_positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
    return sequences


def _graph_logits(model, graph: GraphStep, first: bool, step_ids, step_positions, mask, cache):
    """One decode step's logits ``[N, 1, V]`` from the graph, and the graph to use from here on. The first
    graph step also runs the model's own forward over the dynamic ``cache`` and keeps the graph only where
    its logits are that forward's within ``graph_step.STATIC_BOUND``; otherwise the decode goes on with the
    model's forward, and says so."""
    logits = graph(step_ids, step_positions, mask)
    if not first:
        return logits, graph
    step_mask = model_attention_mask(model, mask, step_ids.shape[1])
    expected = _forward(model, step_ids, step_mask, step_positions, cache).logits
    if graph.check(expected):
        return logits, graph
    fall_back("CUDA graph decode step", graph.failed, "the model's forward at each step")
    return expected, None


def _step_logits(model, lean: LeanStep | None, step_ids, step_mask, step_positions, cache) -> torch.Tensor:
    """One decode step's logits ``[N, 1, V]``: the lean step's where its kind is known to give the model's
    numbers, the model's own forward otherwise. The first step of a kind runs both from the same cache and
    compares the logits and the keys and values written, bit for bit (``lean_step``)."""
    rows = step_ids.shape[0]
    known = None if lean is None else lean.verdict(rows)
    if known:
        return lean(step_ids, step_mask, step_positions, cache)
    logits = _forward(model, step_ids, step_mask, step_positions, cache).logits
    if lean is not None and known is None:
        length = cache.get_seq_length() - step_ids.shape[1]
        written = [(layer.keys[..., length:, :].clone(), layer.values[..., length:, :].clone()) for layer in cache.layers]
        for layer in cache.layers:
            layer.rewind(length)
        same = torch.equal(lean(step_ids, step_mask, step_positions, cache), logits) and all(
            torch.equal(layer.keys[..., length:, :], keys) and torch.equal(layer.values[..., length:, :], values)
            for layer, (keys, values) in zip(cache.layers, written, strict=True)
        )
        lean.record(rows, same)
        if not same:  # the cache holds the model's own keys and values
            for layer, (keys, values) in zip(cache.layers, written, strict=True):
                layer.keys[..., length:, :] = keys
                layer.values[..., length:, :] = values
    return logits


def _forward(model, step_ids, step_mask, step_positions, cache):
    """The model's own forward over a step's columns, keeping the last position's logits."""
    return model(
        input_ids=step_ids,
        attention_mask=step_mask,
        position_ids=step_positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )


@functools.cache
def loop_mismatch() -> str | None:
    """``None`` where the loop samples ``generate``'s tokens on a small random Llama model (two layers,
    grouped key/value heads, three left-padded prompts of two rows each; warped sampling and greedy); else
    why not, with a warning (once per process). The global generator's state is restored afterwards."""
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, attn_implementation="sdpa",
    )
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(2, 96, (6, 7), generator=gen)
        mask = torch.ones_like(ids)
        mask[:2, :3] = mask[2:4, :1] = 0
        ids = ids.masked_fill(mask == 0, 0)
        sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=6)
        for greedy in (False, True):
            runs = []
            for sample in (decode, generate_sequences):
                torch.manual_seed(1)
                runs.append(sample(model, ids, mask, sampling, [1], 0, LogitsProcessorList(), greedy=greedy))
            if not torch.equal(*runs):
                reason = f"it sampled other tokens than generate ({'greedy' if greedy else 'warped sampling'})"
                fall_back("decode loop", reason, "model.generate")
                return reason
    return None
