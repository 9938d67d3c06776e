"""grpo/core/prefix.py: the shared-prefix forward gives the plain forward's numbers (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from grpo.config import config_from_dict
from grpo.core.batching import join_prompt_completion, left_pad
from grpo.core.logprobs import score_completions
from grpo.core.prefix import prefix_groups
from grpo.model.fast import FastPaths
from grpo.model.lora import wrap_lora

G, WIDTH, TEMPERATURE = 3, 5, 0.7


def grouped_batch(pad_id: int, prompt_lengths=(7, 12, 4)):
    """Prompts of different lengths, G completions each, completions stopping at different places."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in prompt_lengths]
    padded = left_pad([p for p in prompts for _ in range(G)], pad_id)
    completions = torch.randint(5, 300, (len(prompts) * G, WIDTH), generator=gen)  # [N, C]
    completion_mask = torch.arange(WIDTH) <= (torch.arange(len(completions)) % WIDTH).unsqueeze(1)  # [N, C]
    joined = join_prompt_completion(padded.input_ids, padded.attention_mask, completions, completion_mask)
    return joined.input_ids, joined.attention_mask, completion_mask


def moved_lora(tiny_model) -> torch.nn.Module:
    """The tiny model under a LoRA adapter that is not zero, in train mode (gradients reach A and B)."""
    model = wrap_lora(tiny_model, config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model.train()


@pytest.fixture
def policy(tiny_model):
    """A LoRA-wrapped tiny model whose adapter is not zero, in train mode (gradients flow)."""
    return moved_lora(tiny_model)


def scored_with_grads(model, input_ids, attention_mask, completion_mask, width, shared_prefix):
    """Log-probs, entropy, a loss of both, and its gradient over the trainable parameters [P]."""
    model.zero_grad(set_to_none=True)
    scored = score_completions(model, input_ids, attention_mask, width, TEMPERATURE, shared_prefix=shared_prefix)
    loss = -(scored.logprobs * completion_mask).sum() - 0.3 * (scored.entropy * completion_mask).sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return scored, loss.detach(), grads


@pytest.mark.parametrize("rows", [slice(None), slice(1, 7), [8, 0, 4, 1]], ids=["all", "split-groups", "shuffled"])
def test_shared_prefix_gives_the_plain_forward_numbers(policy, tiny_tokenizer, rows):
    input_ids, attention_mask, completion_mask = grouped_batch(tiny_tokenizer.pad_token_id)
    batch = input_ids[rows], attention_mask[rows], completion_mask[rows]
    plain, plain_loss, plain_grads = scored_with_grads(policy, *batch, WIDTH, shared_prefix=False)
    fast, fast_loss, fast_grads = scored_with_grads(policy, *batch, WIDTH, shared_prefix=True)
    mask = batch[2]
    torch.testing.assert_close(fast.logprobs[mask], plain.logprobs[mask], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fast.entropy[mask], plain.entropy[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(fast_loss, plain_loss, rtol=1e-6, atol=1e-5)
    assert plain_grads.abs().max() > 1e-3
    torch.testing.assert_close(fast_grads, plain_grads, rtol=1e-5, atol=1e-5)
    for key, value in plain.logits_stats.items():
        assert fast.logits_stats[key] == pytest.approx(value, abs=1e-5)


def test_shared_prefix_with_one_completion_token(policy, tiny_tokenizer):
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    ids, mask = input_ids[:, :-WIDTH + 1], attention_mask[:, :-WIDTH + 1]  # [N, P + 1]
    with torch.no_grad():
        plain = score_completions(policy, ids, mask, 1, TEMPERATURE)
        fast = score_completions(policy, ids, mask, 1, TEMPERATURE, shared_prefix=True)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=1e-5)


def test_each_distinct_prompt_runs_once_per_segment(policy, tiny_tokenizer):
    """The prompt pass sees one row per distinct prompt and every prompt column, one forward per
    segment (its prompts in order of first appearance, as the rollout keeps them); the completion pass
    sees the C completion tokens of each row (the last prompt column's head input scores completion token 0,
    the last token's output nothing, as in a plain forward)."""
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id, prompt_lengths=(7, 12, 4))
    seen = []
    hook = policy.get_base_model().model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        score_completions(policy, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True)
        segments = ["b"] * G + ["a"] * G + ["b"] * G  # prompts 0 and 2 in one segment, prompt 1 in another
        score_completions(policy, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True, segments=segments)
    hook.remove()
    assert seen == [(3, 12), (3 * G, WIDTH), (2, 12), (1, 12), (3 * G, WIDTH)]


def test_the_prompt_pass_takes_the_prompts_in_order_of_first_appearance(policy, tiny_tokenizer):
    """The prefill's rows are the distinct prompts in the order the rows first show them, as the rollout
    keeps its prefill, not in the order their contents sort in (here the reverse: the longest prompt sorts
    last and appears first)."""
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id, prompt_lengths=(12, 7, 4))
    rows = [G, 0, 2 * G, 1]  # prompts 1, 0, 2, 0
    width = input_ids.shape[1] - WIDTH
    seen = []
    hook = policy.get_base_model().model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].clone()))
    with torch.no_grad():
        score_completions(policy, input_ids[rows], attention_mask[rows], WIDTH, TEMPERATURE, shared_prefix=True)
    hook.remove()
    assert torch.equal(seen[0], input_ids[[G, 0, 2 * G], :width])


def test_the_same_rows_and_segments_score_bit_for_bit_alike(policy, tiny_tokenizer):
    """A fresh prefill is the rollout's kept one (the same forward on the same prompts): the update's pass
    and the stored passes of the same rows agree exactly, not only to float reassociation."""
    from grpo.core.prefix import keep_prefills

    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id, prompt_lengths=(7, 12, 4))
    width = input_ids.shape[1] - WIDTH
    segments = ["b"] * G + ["a"] * G + ["b"] * G
    with torch.no_grad():
        kept = keep_prefills(policy, input_ids[::G, :width], attention_mask[::G, :width], ["b", "a", "b"])
        fresh = score_completions(policy, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True,
                                  segments=segments)
        reused = score_completions(policy, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True,
                                   prefills=kept)
    assert torch.equal(fresh.logprobs, reused.logprobs) and torch.equal(fresh.entropy, reused.entropy)


def test_prefix_groups_match_prompts_by_content_not_padding(tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    ids = torch.tensor([[pad, pad, 5, 6], [9, 9, 5, 6], [pad, 7, 5, 6], [pad, pad, 5, 6]])  # [4, 4]
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    groups = prefix_groups(ids, mask)  # rows 0, 1, 3: the same prompt (garbage under padding ignored)
    assert groups.inverse[0] == groups.inverse[1] == groups.inverse[3] != groups.inverse[2]
    assert sorted(groups.first.tolist()) == [0, 2] and groups.start == 1
    zero = prefix_groups(torch.tensor([[0, 5, 6], [0, 5, 6], [3, 5, 6]]), torch.tensor([[0, 1, 1]] * 3))
    assert zero.inverse.tolist() == [0, 0, 0]  # a tokenizer whose padding id is 0 groups alike


def test_shared_prefill_samples_the_plain_generates_tokens(tiny_model, tiny_tokenizer):
    """generate() from a prompt cache computed once per prompt and repeated G times samples, from the
    same seed, exactly the completions of a plain generate() over every row."""
    from grpo.config import SamplingConfig
    from grpo.model.rollout import generate_rollout, stop_ids

    prompts = [tiny_tokenizer.encode(text) for text in ("Context: two friends met.", "Question: who was late?")]
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=2)
    eos = stop_ids(tiny_model, tiny_tokenizer)
    plain = generate_rollout(tiny_model, tiny_tokenizer, prompts, G, sampling, eos, seed=5, fast=FastPaths())
    calls = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    shared = generate_rollout(tiny_model, tiny_tokenizer, prompts, G, sampling, eos, seed=5, shared_prefill=True,
                              fast=FastPaths())
    hook.remove()
    assert torch.equal(shared.completion_ids, plain.completion_ids) and shared.texts == plain.texts
    assert shared.eos_suppressed_frac == plain.eos_suppressed_frac
    width = plain.prompt_ids.shape[1]
    assert calls[:2] == [(2, width - 1), (2 * G, 1)]  # the prompts once, then only their last column


def test_prefilled_cache_gives_the_plain_forwards_next_token_logits(tiny_model, tiny_tokenizer):
    """The last prompt column run against the repeated cache scores the next token exactly as a plain
    forward over the whole left-padded prompt does, for every copy of every prompt."""
    from grpo.core.batching import position_ids_from_mask
    from grpo.core.prefix import prefilled_cache

    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    width = input_ids.shape[1] - WIDTH
    ids, mask = input_ids[:, :width], attention_mask[:, :width]  # [N, P] prompts, G copies each
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        plain = tiny_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        cache = prefilled_cache(tiny_model, ids[::G], mask[::G], G)
        fast = tiny_model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:],
                          past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [slice(None), slice(1, 7), [8, 0, 4, 1]], ids=["all", "split-groups", "shuffled"])
def test_kept_prefill_gives_a_fresh_passs_numbers_and_gradients(policy, tiny_tokenizer, rows):
    """The rollout's prefill kept with its graph (one per segment) stands in for the prompt pass: the
    log-probs, entropy and gradients (those flowing through the kept keys and values included) are a
    fresh forward's, whichever rows are scored and in whatever order."""
    from grpo.core.prefix import keep_prefills

    input_ids, attention_mask, completion_mask = grouped_batch(tiny_tokenizer.pad_token_id)
    batch = input_ids[rows], attention_mask[rows], completion_mask[rows]
    plain, plain_loss, plain_grads = scored_with_grads(policy, *batch, WIDTH, shared_prefix=False)
    width = input_ids.shape[1] - WIDTH
    policy.zero_grad(set_to_none=True)
    kept = keep_prefills(policy, input_ids[::G, :width], attention_mask[::G, :width], ["a", "b", "a"])
    assert [p.index.tolist() for p in kept] == [[0, 2], [1]]
    scored = score_completions(policy, *batch[:2], WIDTH, TEMPERATURE, shared_prefix=True, prefills=kept)
    loss = -(scored.logprobs * batch[2]).sum() - 0.3 * (scored.entropy * batch[2]).sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
    mask = batch[2]
    torch.testing.assert_close(scored.logprobs[mask], plain.logprobs[mask], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(scored.entropy[mask], plain.entropy[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(loss.detach(), plain_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grads, plain_grads, rtol=1e-5, atol=1e-5)


def test_a_kept_prefill_refuses_moved_weights_and_rows_it_does_not_hold(policy, tiny_tokenizer):
    from grpo.core.prefix import PrefillError, keep_prefills

    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    width = input_ids.shape[1] - WIDTH
    kept = keep_prefills(policy, input_ids[:G * 2:G, :width], attention_mask[:G * 2:G, :width], ["a", "a"])
    with pytest.raises(PrefillError, match="have a prompt that no kept prefill has"):
        score_completions(policy, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True, prefills=kept)
    with torch.no_grad():
        next(p for p in policy.parameters() if p.requires_grad).add_(0.1)  # what an optimizer step does
    with pytest.raises(PrefillError, match="of other weights"):
        score_completions(policy, input_ids[:G], attention_mask[:G], WIDTH, TEMPERATURE, shared_prefix=True,
                          prefills=kept)


def test_decode_cache_of_kept_prefills_is_the_prefilled_cache(tiny_model, tiny_tokenizer):
    """The decode loop's cache built from prefills kept per segment holds, row for row, what
    ``prefilled_cache`` computes for the prompts in their order, without the graph, and bit for bit what it
    computes from the same passes (``segments``: what the rollout decodes from when it keeps nothing). The segments order the
    kept prompts as 0, 3, 1, 2: a permutation that is not its own inverse, so putting the prefills back by
    the permutation instead of its inverse gives rows another prompt's keys and values."""
    from grpo.core.prefix import decode_cache, keep_prefills, prefilled_cache

    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id, prompt_lengths=(7, 12, 4, 9))
    width = input_ids.shape[1] - WIDTH
    ids, mask = input_ids[::G, :width], attention_mask[::G, :width]
    expected = prefilled_cache(tiny_model, ids, mask, G)
    segments = ["b", "a", "a", "b"]
    same_passes = prefilled_cache(tiny_model, ids, mask, G, segments)
    kept = keep_prefills(tiny_model, ids, mask, segments)
    assert torch.cat([p.index for p in kept]).tolist() == [0, 3, 1, 2]
    got = decode_cache(tiny_model, kept, G)
    for mine, theirs, plain in zip(got.layers, expected.layers, same_passes.layers, strict=True):
        assert not mine.keys.requires_grad
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-6)
        assert torch.equal(mine.keys, plain.keys) and torch.equal(mine.values, plain.values), "the same passes"


def test_kept_prefill_on_a_qwen_architecture(tiny_tokenizer):
    """The same on a shrunk Qwen2.5 (biased q/k/v projections, its own cache layers, eager and sdpa)."""
    from transformers import AutoModelForCausalLM

    from grpo.core.prefix import keep_prefills
    from grpo.model.architectures import preset_config

    shrunk = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512}
    input_ids, attention_mask, completion_mask = grouped_batch(tiny_tokenizer.pad_token_id)
    width = input_ids.shape[1] - WIDTH
    for implementation in ("sdpa_grouped", "eager"):
        torch.manual_seed(0)
        config = preset_config("qwen2.5-0.5b", shrunk, attn_implementation=implementation)
        model = wrap_lora(AutoModelForCausalLM.from_config(config),
                          config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
        model.train()
        plain, plain_loss, plain_grads = scored_with_grads(model, input_ids, attention_mask, completion_mask, WIDTH,
                                                           shared_prefix=False)
        model.zero_grad(set_to_none=True)
        kept = keep_prefills(model, input_ids[::G, :width], attention_mask[::G, :width], ["x", "y", "x"])
        scored = score_completions(model, input_ids, attention_mask, WIDTH, TEMPERATURE, shared_prefix=True,
                                   prefills=kept)
        loss = -(scored.logprobs * completion_mask).sum() - 0.3 * (scored.entropy * completion_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        torch.testing.assert_close(scored.logprobs[completion_mask], plain.logprobs[completion_mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(grads, plain_grads, rtol=1e-5, atol=1e-5)
        assert plain_grads.abs().max() > 1e-4, implementation


def test_kept_prefills_serve_rows_of_one_later_segment_alone(policy, tiny_tokenizer):
    """A micro-batch of one task's rows (``low_memory`` runs one graph per task) uses only the prefill of
    its own segment: rows found in the second kept prefill alone score as a fresh pass scores them."""
    from grpo.core.prefix import keep_prefills

    input_ids, attention_mask, completion_mask = grouped_batch(tiny_tokenizer.pad_token_id)
    width = input_ids.shape[1] - WIDTH
    rows = slice(G, 2 * G)  # prompt 1, the only prompt of segment "b"
    with torch.no_grad():
        kept = keep_prefills(policy, input_ids[::G, :width], attention_mask[::G, :width], ["a", "b", "a"])
        plain = score_completions(policy, input_ids[rows], attention_mask[rows], WIDTH, TEMPERATURE)
        reused = score_completions(policy, input_ids[rows], attention_mask[rows], WIDTH, TEMPERATURE,
                                   shared_prefix=True, prefills=kept)
    mask = completion_mask[rows]
    torch.testing.assert_close(reused.logprobs[mask], plain.logprobs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(reused.entropy[mask], plain.entropy[mask], rtol=0, atol=1e-5)


def test_a_kept_prefill_refuses_rows_padded_to_another_prompt_width(policy, tiny_tokenizer):
    """Rows re-padded to a wider prompt block are not the rollout's rows: refused with the fix, not a
    broadcasting error from the comparison of prompts."""
    from grpo.core.prefix import PrefillError, keep_prefills

    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    width = input_ids.shape[1] - WIDTH
    with torch.no_grad():
        kept = keep_prefills(policy, input_ids[::G, :width], attention_mask[::G, :width], ["a", "a", "a"])
    pad = torch.full((input_ids.shape[0], 1), tiny_tokenizer.pad_token_id)
    wider_ids, wider_mask = torch.cat([pad, input_ids], dim=1), torch.cat([torch.zeros_like(pad), attention_mask], 1)
    with torch.no_grad(), pytest.raises(PrefillError, match="columns wide"):
        score_completions(policy, wider_ids, wider_mask, WIDTH, TEMPERATURE, shared_prefix=True, prefills=kept)
