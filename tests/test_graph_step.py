"""grpo/model/fast/graph_step.py: the decode loop's steps over a static cache give ``generate``'s tokens.

On a CPU the step runs uncaptured on the same static buffers (the static cache's arithmetic: masked
columns, the column each step writes, positions); on CUDA (``gpu`` tests) it replays a captured graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import DynamicCache

from grpo.model import chat
from grpo.model.fast import decode as decode_module
from grpo.model.fast.graph_step import GraphStep, graph_step_applies
from grpo.model.precision import bf16_autocast
from tests.test_decode import SAMPLINGS, _decode, _generate, _prompts, varied_policy


@pytest.fixture
def policy(tiny_model, tiny_tokenizer):
    return varied_policy(tiny_model, tiny_tokenizer)


@pytest.fixture
def uncaptured(monkeypatch):
    """Every decode builds an uncaptured graph step (the CPU's stand-in for the CUDA graph); the list
    collects the steps built."""
    built: list[GraphStep] = []

    def build(model, cache, rows, width):
        if not isinstance(cache, DynamicCache):
            return None
        built.append(GraphStep.over(model, cache, rows, width, capture=False))
        return built[-1]

    monkeypatch.setattr(decode_module.GraphStep, "build", staticmethod(build))
    return built


@pytest.mark.parametrize("prefilled", [False, True], ids=["plain-prefill", "shared-prefill"])
@pytest.mark.parametrize("mode", [*SAMPLINGS, "greedy"])
def test_static_cache_steps_give_generates_tokens(policy, tiny_tokenizer, uncaptured, mode, prefilled):
    sampling = SAMPLINGS.get(mode, SAMPLINGS["plain"])
    greedy = mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    completions = set()
    for seed in (0, 1):
        expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed)
        got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed, prefilled)
        assert torch.equal(got, expected), f"seed {seed}: the static-cache steps sampled other tokens"
        completions |= {tuple(row) for row in expected[:, batch.input_ids.shape[1]:].tolist()}
    assert uncaptured and all(step.failed is None for step in uncaptured), "every decode ran the static steps"
    assert len(completions) > 3, "completions vary (a real comparison)"


def test_static_cache_steps_under_bf16_autocast_give_generates_tokens(policy, tiny_tokenizer, uncaptured):
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    with bf16_autocast(torch.device("cpu"), True, force=True):
        for seed in (0, 1):
            expected = _generate(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, False, seed)
            got = _decode(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, False, seed, False)
            assert torch.equal(got, expected)
    assert uncaptured and all(step.failed is None for step in uncaptured)


_LOAD = GraphStep.load


def _zeroed_first_column(step, ids, positions, mask):
    _LOAD(step, ids, positions, mask)
    for layer in step.cache.layers:
        layer.keys[..., 0, :] = 0.0


def _column_after(step, ids, positions, mask):
    _LOAD(step, ids, positions, mask)
    step.cache_position.add_(1)  # writes one column late: the query misses its own key


def _position_after(step, ids, positions, mask):
    _LOAD(step, ids, positions + 1, mask)


def _own_column_masked(step, ids, positions, mask):
    _LOAD(step, ids, positions, mask)
    step.mask[:, 0, 0, mask.shape[1] - 1] = False


SLIPS = {
    "a key column lost": _zeroed_first_column,
    "the step's column one late": _column_after,
    "a position off by one": _position_after,
    "the step's own key masked": _own_column_masked,
}


@pytest.mark.parametrize("slip", SLIPS)
def test_a_step_whose_logits_differ_is_refused_and_the_models_forward_goes_on(
    policy, tiny_tokenizer, uncaptured, monkeypatch, slip
):
    """Planted slips in the static step: the first step's check sees other logits, warns, and the decode goes
    on with the model's own forward: still ``generate``'s tokens."""
    monkeypatch.setattr(decode_module.GraphStep, "load", SLIPS[slip])
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    expected = _generate(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, True, 0)
    with pytest.warns(UserWarning, match="CUDA graph decode step.*graph step's logits differ"):
        got = _decode(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, True, 0, False)
    assert torch.equal(got, expected)
    assert uncaptured[0].failed is not None and uncaptured[0].gap > 1e-3


def test_load_marks_the_written_columns_and_the_step_column(policy, tiny_tokenizer):
    batch = _prompts(tiny_tokenizer)
    out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True)
    rows, columns = batch.input_ids.shape
    step = GraphStep.over(policy, out.past_key_values, rows, columns + 5, capture=False)
    mask = torch.cat([batch.attention_mask, torch.ones(rows, 1, dtype=batch.attention_mask.dtype)], dim=1)
    step.load(torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), 7), mask)
    assert step.mask.shape == (rows, 1, 1, columns + 5)
    assert torch.equal(step.mask[:, 0, 0, : columns + 1], mask.bool())
    assert not step.mask[:, 0, 0, columns + 1 :].any(), "columns not yet written are masked"
    assert int(step.cache_position) == columns, "the step writes the column after the prompt"
    assert torch.equal(step.positions, torch.full((rows, 1), 7))
    for layer, source in zip(step.cache.layers, out.past_key_values.layers, strict=True):
        assert torch.equal(layer.keys[..., :columns, :], source.keys)
        assert not layer.keys[..., columns:, :].any()


def test_graph_step_applies_only_on_cuda_in_eval_mode_with_the_prepared_mask(policy, tiny_tokenizer):
    batch = _prompts(tiny_tokenizer)
    cache = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True).past_key_values
    assert not graph_step_applies(policy, cache), "a CPU model decodes through lean_step, not a graph"
    assert GraphStep.build(policy, cache, batch.input_ids.shape[0], 40) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mode", ["plain", "warped", "greedy"])
def test_cuda_decode_replays_a_graph_and_gives_generates_tokens(policy, tiny_tokenizer, mode, bf16, monkeypatch):
    built: list[GraphStep] = []
    build = GraphStep.build
    monkeypatch.setattr(
        decode_module.GraphStep, "build", staticmethod(lambda *a: built.append(build(*a)) or built[-1])
    )
    policy = policy.cuda()
    sampling, greedy = SAMPLINGS.get(mode, SAMPLINGS["plain"]), mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    host = _prompts(tiny_tokenizer)
    batch = SimpleNamespace(input_ids=host.input_ids.cuda(), attention_mask=host.attention_mask.cuda())
    with bf16_autocast(torch.device("cuda"), bf16):
        for seed in (0, 1):
            expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed)
            got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed, prefilled=seed == 1)
            assert torch.equal(got, expected), f"seed {seed}: the graph's tokens are not generate's"
    assert built and all(s is not None and s.graph is not None and s.failed is None for s in built)


def _checked(policy, tiny_tokenizer, got, expected, bf16):
    batch = _prompts(tiny_tokenizer)
    out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True)
    step = GraphStep.over(policy, out.past_key_values, *batch.input_ids.shape, capture=False)
    step.logits = got
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return step.check(expected), step


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_check_bounds_the_gap_by_the_model_forwards_scale(policy, tiny_tokenizer, bf16):
    """The bound is ``STATIC_BOUND`` (1e-4 in fp32, 5e-2 under bf16 autocast) times the scale of the model's own
    logits: a gap just inside passes, just outside fails, also where the graph's logits (inflated by the slip)
    would widen their own bound; a NaN in the graph's logits fails."""
    expected = torch.zeros(2, 1, 8)
    expected[0, 0, 3] = 100.0
    bound = (5e-2 if bf16 else 1e-4) * 100.0
    for gap, ok in ((0.98 * bound, True), (1.02 * bound, False)):
        got = expected.clone()
        got[0, 0, 3] += gap  # the largest logit inflated: its own scale would allow 1.02 x the bound
        passed, step = _checked(policy, tiny_tokenizer, got, expected, bf16)
        assert passed is ok and (step.failed is None) is ok and step.gap == pytest.approx(gap, rel=1e-3)
    got = expected.clone()
    got[1, 0, 5] = float("nan")
    passed, step = _checked(policy, tiny_tokenizer, got, expected, bf16)
    assert not passed and "differ" in step.failed
