"""grpo/model/engines.py and vllm_engine.py: the engine interface on CPU with the HF engine; the
vLLM engine's CPU-side parts (assembly, merged weights); its GPU tests are marked ``gpu``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo.config import ConfigError, LoraConfig, RolloutConfig, SamplingConfig, config_from_dict
from grpo.core.batching import completion_mask, left_pad
from grpo.core.importance import rollout_mismatch
from grpo.data.prompts import example_messages
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.engine_types import EngineRollout
from grpo.model.engines import HFEngine, make_engine
from grpo.model.fast import FastPaths
from grpo.model.lora import wrap_lora
from grpo.model.rollout import generate_rollout
from grpo.model.vllm_engine import assemble, merged_weights, sampling_kwargs
from grpo.train.mismatch import trainer_logprobs

HAS_VLLM = importlib.util.find_spec("vllm") is not None
RECORDS = [
    {"task": "hallucination", "context": "Elbrook was founded in 1821.", "question": "When?", "answer": "1821",
     "answerable": True},
    {"task": "hallucination", "context": "The town is known for glass.", "question": "Who founded it?",
     "answer": None, "answerable": False},
]
SAMPLING = SamplingConfig(max_new_tokens=6, min_new_tokens=2, presence_penalty=0.5)


def _prompts(tokenizer) -> list[list[int]]:
    return [render_prompt(tokenizer, example_messages(r)) for r in RECORDS]


def test_hf_engine_is_generate_rollout(tiny_model, tiny_tokenizer):
    """Same ids, masks and texts as rollout.generate_rollout for the same seed; no sampler log-probs."""
    eos = end_of_turn_ids(tiny_tokenizer)
    engine = make_engine(RolloutConfig(), tiny_model, tiny_tokenizer, fast=FastPaths())
    assert isinstance(engine, HFEngine) and engine.name == "hf"
    out = engine.generate(_prompts(tiny_tokenizer), 3, SAMPLING, eos, seed=11)
    direct = generate_rollout(tiny_model, tiny_tokenizer, _prompts(tiny_tokenizer), 3, SAMPLING, eos, seed=11,
                              fast=FastPaths())
    assert isinstance(out, EngineRollout) and out.sampler_logprobs is None
    assert out.rollout.completion_ids.shape[0] == 6
    assert torch.equal(out.rollout.completion_ids, direct.completion_ids)
    assert torch.equal(out.rollout.completion_mask, direct.completion_mask) and out.rollout.texts == direct.texts
    engine.sync_weights(tiny_model)  # the trainer's model itself: nothing to copy


def test_hf_engine_refuses_to_sync_another_model(tiny_model, tiny_tokenizer, tiny_sizes):
    from grpo.model.tiny import build_tiny_model

    engine = HFEngine(tiny_model, tiny_tokenizer, fast=FastPaths())
    with pytest.raises(ValueError, match="trainer's model itself"):
        engine.sync_weights(build_tiny_model(tiny_tokenizer, tiny_sizes, seed=1))


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_config_rejects_vllm_when_it_is_not_installed():
    with pytest.raises(ConfigError, match=r"grpo.rollout.engine is 'vllm' but vLLM is not installed.*\[vllm\]"):
        config_from_dict({"grpo": {"rollout": {"engine": "vllm"}}})
    assert config_from_dict({"grpo": {"rollout": {"engine": "hf"}}}).grpo.rollout.engine == "hf"


def test_engine_token_lists_become_the_hf_rollout(tiny_tokenizer):
    """An engine's per-row tokens -> left-padded prompts, positional masks up to the first stop (I4, I5)."""
    eos = end_of_turn_ids(tiny_tokenizer)
    stop, pad = eos[0], tiny_tokenizer.pad_token_id
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[20, 21, stop], [30, 31, 32, 33]]  # stopped; truncated at max_new_tokens
    logprobs = [[-0.1, -0.2, -0.3], [-1.0, -1.1, -1.2, -1.3]]
    out = assemble(tiny_tokenizer, prompts, completions, logprobs, eos, SAMPLING, group_size=1)
    rollout = out.rollout
    assert torch.equal(rollout.prompt_ids, left_pad(prompts, pad).input_ids)
    assert rollout.completion_ids.tolist() == [[20, 21, stop, pad], [30, 31, 32, 33]]
    assert torch.equal(rollout.completion_mask, completion_mask(rollout.completion_ids, eos).mask)
    assert rollout.completion_mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert rollout.lengths.tolist() == [3, 4] and rollout.truncated.tolist() == [False, True]
    torch.testing.assert_close(out.sampler_logprobs, torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-1.0, -1.1, -1.2, -1.3]]))
    assert rollout.texts[0] == tiny_tokenizer.decode([20, 21], skip_special_tokens=True)
    grouped = assemble(tiny_tokenizer, prompts[:1] * 2 + prompts[1:] * 2, completions * 2, logprobs * 2, eos,
                       SAMPLING, group_size=2).rollout
    assert grouped.group_size == 2  # dynamic sampling and the per-row tasks read the groups from it


def test_the_merged_context_merges_the_adapter_inside_and_unmerges_after(tiny_model):
    """The weights vLLM reads inside; after it the adapter is apart again, so training goes on through it."""
    from grpo.model.vllm_engine import _merged

    torch.manual_seed(0)
    policy = wrap_lora(tiny_model, LoraConfig(r=2, alpha=4, target_modules=["q_proj"]))
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    before = layer.base_layer.weight.detach().clone()
    with _merged(policy):
        assert layer.merged and not torch.equal(layer.base_layer.weight, before)
    assert not layer.merged
    torch.testing.assert_close(layer.base_layer.weight, before)
    plain = tiny_model.__class__(tiny_model.config)  # a model without an adapter: nothing to merge or unmerge
    weights = [p.detach().clone() for p in plain.parameters()]
    with _merged(plain):
        pass
    assert all(torch.equal(a, b) for a, b in zip(weights, plain.parameters(), strict=True))


def test_merged_weights_are_the_plain_names_with_the_adapter_folded_in(tiny_model):
    plain = dict(tiny_model.named_parameters())
    q_before = plain["model.layers.0.self_attn.q_proj.weight"].detach().clone()
    torch.manual_seed(0)
    policy = wrap_lora(tiny_model, LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    delta = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # scale = alpha / r
    policy.merge_adapter()
    merged = dict(merged_weights(policy))
    assert set(merged) == set(plain)
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], q_before + delta)
    policy.unmerge_adapter()
    torch.testing.assert_close(layer.base_layer.weight, q_before)


gpu = pytest.mark.gpu
needs_vllm = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_VLLM), reason="needs CUDA and vLLM")


@pytest.fixture
def on_vllm(tiny_model, tiny_tokenizer):
    """The tiny model on the GPU and a colocated vLLM engine built from it."""
    model = tiny_model.cuda()
    return model, make_engine(RolloutConfig(engine="vllm"), model, tiny_tokenizer, max_model_len=256, seed=0, fast=FastPaths())


def _vllm_rollout(engine, model, tokenizer, seed: int):
    """One vLLM rollout of the two prompts and its mismatch with the trainer's scoring."""
    out = engine.generate(_prompts(tokenizer), 4, SAMPLING, end_of_turn_ids(tokenizer), seed=seed)
    assert out.sampler_logprobs is not None and out.sampler_logprobs.shape == out.rollout.completion_ids.shape
    trainer = trainer_logprobs(model, out.rollout)
    return out.rollout, rollout_mismatch(trainer, out.sampler_logprobs, out.rollout.completion_mask)


@gpu
@needs_vllm
def test_vllm_engine_follows_the_hf_rules_and_matches_the_trainer(on_vllm, tiny_tokenizer):
    """Stop tokens, min-tokens and the positional mask as on the HF path; small log-prob mismatch."""
    model, engine = on_vllm
    rollout, stats = _vllm_rollout(engine, model, tiny_tokenizer, seed=3)
    assert (rollout.lengths >= SAMPLING.min_new_tokens).all() and (rollout.lengths <= SAMPLING.max_new_tokens).all()
    eos = set(end_of_turn_ids(tiny_tokenizer))
    for ids, n, cut in zip(rollout.completion_ids, rollout.lengths, rollout.truncated, strict=True):
        assert cut or int(ids[int(n) - 1]) in eos  # a stopped completion ends on a stop id
    assert stats["sampling/sampling_logp_difference/mean"] < 0.05


@gpu
@needs_vllm
def test_vllm_engine_samples_from_the_synced_weights(on_vllm, tiny_tokenizer):
    model, engine = on_vllm
    before, _ = _vllm_rollout(engine, model, tiny_tokenizer, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a very different policy
    engine.sync_weights(model)
    after, stats = _vllm_rollout(engine, model, tiny_tokenizer, seed=3)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert stats["sampling/sampling_logp_difference/mean"] < 0.05  # vLLM samples from the synced weights


def test_vllm_sampling_follows_the_hf_rules():
    """Stop ids, the min-token rule, completion-only penalties (I6), no top-k, the sampled log-prob."""
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=12, min_new_tokens=3,
                              presence_penalty=0.4, frequency_penalty=0.2)
    kwargs = sampling_kwargs(sampling, [7, 9], seed=5)
    assert kwargs["stop_token_ids"] == [7, 9] and not kwargs["ignore_eos"]
    assert (kwargs["min_tokens"], kwargs["max_tokens"]) == (3, 12)
    assert (kwargs["presence_penalty"], kwargs["frequency_penalty"], kwargs["repetition_penalty"]) == (0.4, 0.2, 1.0)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, -1)
    assert kwargs["logprobs"] == 0 and kwargs["seed"] == 5 and kwargs["n"] == 1
    assert sampling_kwargs(SamplingConfig(top_k=20), [7], seed=0)["top_k"] == 20
