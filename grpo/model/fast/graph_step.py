"""``GraphStep``: a GPU decode loop's one-token steps replayed from a CUDA graph over a static key/value cache.

A decode step of a few dozen rows on a GPU is bound by launching kernels, not by computing them: every
step launches the model's whole forward (about a thousand kernels for a 0.5B model) from Python, and the
GPU waits for each launch. Hugging Face's answer is a static cache and ``torch.compile(mode="reduce-
overhead")``; this module takes the same static cache (transformers' ``StaticCache``) and captures the
model's own forward of one decode step as a CUDA graph, once per decode, without a compiler: each later
step copies its inputs into the graph's buffers and replays every kernel with one launch.

The step's inputs are static buffers: the token ids and positions ``[N, 1]``, the column the step writes
(``cache_position``) and the attention mask ``[N, 1, 1, L]`` over the whole cache width ``L`` (prompt
plus ``max_new_tokens``), True for the real columns written so far, False beyond. The keys of the columns
not yet written are masked out: the attention's softmax gives them weight exactly 0, so the logits are
those of the same step over the columns written so far (``tests/test_graph_step.py`` on the CPU, the
``gpu`` tests against ``generate`` on CUDA). Sampling stays outside the graph, in the decode loop, so the
draws come from the same generator in the same order as ``generate``'s.

The first step of a decode checks itself: its logits must be the model's own forward's over the dynamic
cache within the rounding another summation order allows (``STATIC_BOUND``). Where either fails the decode goes on with the
model's own forward (a warning names the difference), so a transformers release whose model does something
a graph cannot replay never changes a token silently.

Not used (``GraphStep.build`` returns ``None``): devices other than CUDA (on a CPU ``lean_step`` serves
the same purpose), models whose attention does not take the prepared 4D mask (``core.attention``), caches
with sliding or chunked layers, sharded (FSDP) models, or a model in training mode.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer

from grpo.core.attention import SDPA_IMPLEMENTATIONS, takes_prepared_mask


class GraphStep:
    """One-token decode steps of ``model`` over a static cache of width ``width``, replayed from a CUDA graph
    (``capture``) or run eagerly on the same static buffers (``capture=False``: the CPU tests' way to check
    the static cache's arithmetic)."""

    def __init__(self, model: torch.nn.Module, cache: StaticCache, rows: int, width: int, capture: bool) -> None:
        device = next(model.parameters()).device
        self.model, self.cache, self.capture = model, cache, capture
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [N, 1]
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [N, 1]
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool, device=device)  # [N, 1, 1, L]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [N, 1, V] the last step's (the captured forward's output buffer)
        self.failed: str | None = None  # why the self-check refused the graph, once it did
        self.gap: float | None = None  # the self-check's largest logit difference from the dynamic cache

    @classmethod
    def build(cls, model: torch.nn.Module, cache, rows: int, width: int) -> GraphStep | None:
        """A graph step over ``cache`` (the decode's dynamic cache after the prefill) copied into a static
        cache of ``width`` columns, or ``None`` where ``graph_step_applies`` says no."""
        if not graph_step_applies(model, cache):
            return None
        return cls.over(model, cache, rows, width, capture=True)

    @classmethod
    def over(cls, model: torch.nn.Module, cache: DynamicCache, rows: int, width: int, capture: bool) -> GraphStep:
        """A step over a static copy of ``cache`` with ``width`` columns, without ``build``'s checks."""
        return cls(model, static_copy(model, cache, width), rows, width, capture)

    def load(self, step_ids: torch.Tensor, step_positions: torch.Tensor, mask: torch.Tensor) -> None:
        """Copy one step's inputs into the buffers: ids and positions ``[N, 1]``, the 2D mask ``[N, K]``
        of every column written so far and this step's (``K`` <= width; the step writes column K - 1)."""
        columns = mask.shape[1]
        self.ids.copy_(step_ids)
        self.positions.copy_(step_positions)
        self.cache_position.fill_(columns - 1)
        self.mask[:, 0, 0, :columns].copy_(mask.bool())

    def forward(self) -> torch.Tensor:
        """The model's own forward over the buffers -> logits [N, 1, V] of the last position."""
        return self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            cache_position=self.cache_position,
            use_cache=True,
            logits_to_keep=1,
        ).logits

    def __call__(self, step_ids: torch.Tensor, step_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One decode step's logits [N, 1, V] (a view of the graph's output buffer: read it before the next step)."""
        self.load(step_ids, step_positions, mask)
        if not self.capture:
            self.logits = self.forward()
            return self.logits
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        """Warm up on a side stream (the first runs allocate and pick kernels), then capture one step.

        Autocast's cache of cast weights must stay off while capturing: a cast cached inside the graph's
        memory would outlive it. Each run writes the same keys and values into the same column, so the
        warm-up leaves the cache as one step would."""
        kind = "cuda"
        autocast = torch.autocast(
            kind,
            dtype=torch.get_autocast_dtype(kind),
            enabled=torch.is_autocast_enabled(kind),
            cache_enabled=False,
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast:
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), autocast:
            self.logits = self.forward()
        self.graph = graph

    def check(self, expected: torch.Tensor) -> bool:
        """Whether this step's logits may stand in for the model's own forward: within ``STATIC_BOUND`` of
        the logits' scale of ``expected`` (the model's own forward of the same step over the dynamic cache,
        [N, 1, V]). Call right after the step; on ``False`` ``failed`` says what differed; ``gap`` holds
        the largest difference either way."""
        got = self.logits.float()
        self.gap = float((got - expected.float()).abs().max())
        scale = max(1.0, float(expected.float().abs().max()))
        bound = STATIC_BOUND[torch.is_autocast_enabled(got.device.type)] * scale
        if not self.gap <= bound:  # a NaN gap fails too
            self.failed = f"the graph step's logits differ from the model's own forward by {self.gap:.3g} > {bound:.3g}"
        return self.failed is None


STATIC_BOUND = {False: 1e-4, True: 5e-2}
"""Largest difference of a graph step's logits from the model's own forward over the dynamic cache, relative
to the logits' scale, without autocast and under bf16 autocast. The columns not yet written weigh exactly 0,
but an attention kernel may sum a longer row of keys in another order (a CPU's vector lanes do) and a
captured product may run another of the library's kernels (another summation order): fp32 roundings, or
bf16 roundings of the activations under autocast. A slip (a column attended before it is written, a wrong
position or cache column) moves the logits by the scale of the logits themselves."""


def graph_step_applies(model: torch.nn.Module, cache) -> bool:
    """Whether a graph step can stand in for ``model``'s forward: CUDA weights, eval mode, an attention that
    reads the prepared causal+padding mask (``sdpa``), a dynamic cache of full-attention layers, no FSDP."""
    parameter = next(model.parameters(), None)
    return (
        parameter is not None
        and parameter.device.type == "cuda"
        and not model.training
        and takes_prepared_mask(model)
        and model.config._attn_implementation in SDPA_IMPLEMENTATIONS
        and isinstance(cache, DynamicCache)
        and all(isinstance(layer, DynamicLayer) for layer in cache.layers)
        and not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    )


class KeptDtypeLayer(StaticLayer):
    """A ``StaticLayer`` whose keys and values keep the dtypes of the prefill's: under autocast a step's new
    keys or values may come in another dtype than the prompt's (a bf16 projection after an fp32 one), and
    the dynamic cache concatenates them into the prompt's dtype, so this layer casts them into it too."""

    def update(self, key_states, value_states, cache_kwargs=None):
        return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), cache_kwargs)


def static_copy(model: torch.nn.Module, cache: DynamicCache, width: int) -> StaticCache:
    """A ``StaticCache`` of ``width`` columns holding ``cache``'s keys and values in its first columns."""
    static = StaticCache(config=model.config, max_cache_len=width)
    for layer, source in zip(static.layers, cache.layers, strict=True):
        layer.__class__ = KeptDtypeLayer
        layer.lazy_initialization(source.keys)
        layer.values = layer.values.to(source.values.dtype)
        length = source.keys.shape[-2]
        layer.keys[..., :length, :].copy_(source.keys)
        layer.values[..., :length, :].copy_(source.values)
    return static
