"""grpo/model/rollout.py: G completions per prompt as token ids, greedy or sampled, grouped by prompt."""

from __future__ import annotations

import pytest
import torch

from grpo.config import SamplingConfig
from grpo.core.batching import left_pad
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.fast import FastPaths
from grpo.model.rollout import concat_rollouts, generate_rollout, sample_rollout, select_groups, stop_ids

SAMPLING = SamplingConfig(max_new_tokens=6)
MESSAGES = (
    [{"role": "user", "content": "Who was late?"}],
    [{"role": "system", "content": "Answer only from the context."},
     {"role": "user", "content": "Context: Mara Venn founded Elbrook. Question: Who founded Elbrook?"}],
)


@pytest.fixture
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [render_prompt(tiny_tokenizer, messages) for messages in MESSAGES]


def rollout(model, tokenizer, prompts, group_size=3, seed=0, greedy=False, sampling=SAMPLING, with_entropy=False):
    return generate_rollout(model, tokenizer, prompts, group_size, sampling, stop_ids(model, tokenizer), seed,
                            greedy=greedy, with_entropy=with_entropy, fast=FastPaths())


def test_row_i_belongs_to_prompt_i_over_group_size(tiny_model, tiny_tokenizer, prompts):
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=3)
    n = len(prompts) * 3
    assert out.prompt_ids.shape[0] == out.completion_ids.shape[0] == n and out.group_size == 3
    assert len(out.texts) == len(out.raw_texts) == n
    padded = left_pad(prompts, tiny_tokenizer.pad_token_id)
    for row in range(n):
        assert torch.equal(out.prompt_ids[row], padded.input_ids[row // 3])
        assert torch.equal(out.prompt_mask[row], padded.attention_mask[row // 3])


def test_completion_mask_runs_up_to_and_including_the_first_stop(tiny_model, tiny_tokenizer, prompts):
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=4, seed=1)
    stops = set(stop_ids(tiny_model, tiny_tokenizer))
    assert out.completion_ids.shape[1] <= SAMPLING.max_new_tokens
    for ids, mask, length, truncated in zip(out.completion_ids, out.completion_mask, out.lengths, out.truncated,
                                            strict=True):
        n = int(length)
        assert mask[:n].all() and not mask[n:].any() and int(mask.sum()) == n
        first_stop = next((i for i, t in enumerate(ids.tolist()) if t in stops), None)
        assert bool(truncated) == (first_stop is None)
        if first_stop is not None:
            assert n == first_stop + 1


def test_same_seed_same_rollout_and_the_global_generator_is_untouched(tiny_model, tiny_tokenizer, prompts):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = rollout(tiny_model, tiny_tokenizer, prompts, seed=7)
    assert torch.equal(torch.get_rng_state(), state), "sampling moved the global generator"
    again = rollout(tiny_model, tiny_tokenizer, prompts, seed=7)
    other = rollout(tiny_model, tiny_tokenizer, prompts, seed=8)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_greedy_is_the_argmax_path_whatever_the_seed(tiny_model, tiny_tokenizer, prompts):
    greedy = rollout(tiny_model, tiny_tokenizer, prompts, group_size=2, seed=1, greedy=True)
    reseeded = rollout(tiny_model, tiny_tokenizer, prompts, group_size=2, seed=99, greedy=True)
    assert torch.equal(greedy.completion_ids, reseeded.completion_ids)
    assert torch.equal(greedy.completion_ids[0], greedy.completion_ids[1])  # one group, one argmax path
    # The first generated token is the argmax of the model's next-token logits after the prompt.
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompts[0]])).logits[0, -1]
    assert int(greedy.completion_ids[0, 0]) == int(logits.argmax())


def test_greedy_keeps_the_rollout_processors(tiny_model, tiny_tokenizer, prompts):
    """min_new_tokens == max_new_tokens: the EOS suppressor holds every completion open, greedy too."""
    forced = SamplingConfig(max_new_tokens=5, min_new_tokens=5)
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=1, greedy=True, sampling=forced)
    assert out.truncated.all() and (out.lengths == 5).all()
    assert not torch.isin(out.completion_ids, torch.tensor(stop_ids(tiny_model, tiny_tokenizer))).any()


def test_select_groups_keeps_whole_groups_in_the_given_order(tiny_model, tiny_tokenizer, prompts):
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=2, seed=3)
    picked = select_groups(out, [1, 0])
    assert torch.equal(picked.completion_ids, out.completion_ids[[2, 3, 0, 1]])
    assert picked.texts == [out.texts[i] for i in (2, 3, 0, 1)] and picked.group_size == 2
    assert picked.entropy is None
    measured = rollout(tiny_model, tiny_tokenizer, prompts, group_size=2, seed=3, with_entropy=True)
    assert torch.equal(select_groups(measured, [1, 0]).entropy, measured.entropy[[2, 3, 0, 1]])


def test_concat_pads_prompts_left_and_completions_right(tiny_model, tiny_tokenizer, prompts):
    short = rollout(tiny_model, tiny_tokenizer, prompts[:1], group_size=2, seed=4)
    long = rollout(tiny_model, tiny_tokenizer, prompts[1:], group_size=2, seed=5)
    both = concat_rollouts([short, long], tiny_tokenizer.pad_token_id)
    width = max(short.prompt_ids.shape[1], long.prompt_ids.shape[1])
    assert both.prompt_ids.shape == (4, width)
    # The short prompts keep their ids at the right end; the added positions are masked out.
    assert torch.equal(both.prompt_ids[:2, -short.prompt_ids.shape[1]:], short.prompt_ids)
    assert not both.prompt_mask[:2, : width - short.prompt_ids.shape[1]].any()
    assert torch.equal(both.completion_mask.sum(dim=1), torch.cat([short.lengths, long.lengths]))
    assert both.entropy is None
    measured = [rollout(tiny_model, tiny_tokenizer, p, group_size=2, seed=s, with_entropy=True)
                for p, s in ((prompts[:1], 4), (prompts[1:], 5))]
    entropy = concat_rollouts(measured, tiny_tokenizer.pad_token_id).entropy
    assert entropy.shape == both.completion_mask.shape and torch.equal(entropy != 0, both.completion_mask)
    assert entropy.sum() == pytest.approx(float(measured[0].entropy.sum() + measured[1].entropy.sum()))


def test_concat_weighs_each_parts_eos_suppression_by_its_rows(tiny_model, tiny_tokenizer, prompts):
    """The stacked rollout's ``eos_suppressed_frac`` is the row-weighted mean of its parts' (dynamic sampling
    stacks a first draw with a smaller resample): a part of 2 rows at 1.0 and one of 4 at 0.0 give 1/3."""
    import dataclasses

    small = rollout(tiny_model, tiny_tokenizer, prompts[:1], group_size=2, seed=4)
    large = rollout(tiny_model, tiny_tokenizer, prompts, group_size=2, seed=5)
    assert (len(small.texts), len(large.texts)) == (2, 4)
    parts = [dataclasses.replace(small, eos_suppressed_frac=1.0), dataclasses.replace(large, eos_suppressed_frac=0.0)]
    assert concat_rollouts(parts, tiny_tokenizer.pad_token_id).eos_suppressed_frac == pytest.approx(1 / 3)


def test_the_sampler_record_follows_its_rows_through_selection_and_concatenation(tiny_model, tiny_tokenizer, prompts):
    """``Rollout.sampler`` (asked for with ``with_sampler``) keeps each row's record: selected groups keep
    theirs, stacked rollouts pad theirs as after a stop token (pad id, 0, not reshaped)."""
    parts = []
    for p, seed in ((prompts[:1], 4), (prompts[1:], 5)):
        out, _ = sample_rollout(tiny_model, tiny_tokenizer, p, 2, SAMPLING, stop_ids(tiny_model, tiny_tokenizer),
                                seed, fast=FastPaths(), with_sampler=True)
        assert out.sampler is not None and torch.equal(out.sampler.ids, out.completion_ids)
        parts.append(out)
    assert rollout(tiny_model, tiny_tokenizer, prompts).sampler is None, "only where asked"
    both = concat_rollouts(parts, tiny_tokenizer.pad_token_id)
    assert torch.equal(both.sampler.ids, both.completion_ids)
    for field, part in zip(both.sampler, parts[1].sampler, strict=True):
        assert field.shape == both.completion_ids.shape and torch.equal(field[2:, : part.shape[1]], part)
    picked = select_groups(both, [1])
    assert all(torch.equal(a, b[2:]) for a, b in zip(picked.sampler, both.sampler, strict=True))


def test_i3_the_rollout_keeps_the_generated_ids(tiny_model, tiny_tokenizer, prompts):
    """The completions are the decode loop's own tokens after the padded prompt width, never decoded text
    encoded again (which would not give back a stop token, pads, or byte-split pieces)."""
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=3, seed=2)
    width = out.prompt_ids.shape[1]
    assert torch.equal(out.sequences[:, :width], out.prompt_ids)
    assert torch.equal(out.completion_ids, out.sequences[:, width:])


def test_i4_the_reward_texts_are_the_completions_decoded(tiny_model, tiny_tokenizer, prompts):
    """What the rewards and the monitor read is each completion's own ids up to its stop, decoded: no
    prompt text, none of the padding after it."""
    out = rollout(tiny_model, tiny_tokenizer, prompts, group_size=3, seed=2)
    for i, n in enumerate(out.lengths.tolist()):
        ids = out.completion_ids[i, :n].tolist()
        assert out.texts[i] == tiny_tokenizer.decode(ids, skip_special_tokens=True), i
        assert out.raw_texts[i] == tiny_tokenizer.decode(ids, skip_special_tokens=False), i


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_i6_processors_count_completion_tokens_of_a_short_first_prompt(tiny_model, tiny_tokenizer, prompts, penalty):
    """The rollout's own processors, the shortest prompt first: a token favoured by a bias of 200 at the end
    of every prompt is drawn first (the penalty counts the completion only) and not again (it does count
    the completion); with the stop tokens favoured, EOS suppression holds every row to two tokens."""
    from grpo.checks.behaviour import biased

    short_first = sorted(prompts, key=len)
    favoured = short_first[0][-1]
    eos = stop_ids(tiny_model, tiny_tokenizer)
    sampling = SamplingConfig(max_new_tokens=3, min_new_tokens=0, **{penalty: 400.0})
    with biased(tiny_model, [favoured]):
        out = rollout(tiny_model, tiny_tokenizer, short_first, group_size=2, sampling=sampling)
    assert out.completion_ids[:, 0].tolist() == [favoured] * 4
    assert (out.completion_ids[:, 1] != favoured).all()
    with biased(tiny_model, eos):
        out = rollout(tiny_model, tiny_tokenizer, short_first, group_size=2,
                      sampling=SamplingConfig(max_new_tokens=3, min_new_tokens=2))
    assert out.lengths.tolist() == [3] * 4 and not out.truncated.any()


def test_stop_ids_add_the_models_own_generation_eos(tiny_model, tiny_tokenizer):
    ids = stop_ids(tiny_model, tiny_tokenizer)
    assert set(end_of_turn_ids(tiny_tokenizer)) <= set(ids)
    own = tiny_model.generation_config.eos_token_id
    assert set(own if isinstance(own, list) else [own]) <= set(ids)
    assert len(ids) == len(set(ids))


def test_bf16_rollout_casts_frozen_weights_once_and_samples_the_same_tokens(tiny_model, tiny_tokenizer, prompts,
                                                                             monkeypatch):
    """Under bf16 autocast the rollout of a LoRA policy casts its frozen weights once per call
    (``precision.cast_frozen_weights_once``), not at every decode step: same tokens, fewer casts."""
    import contextlib

    from grpo.config import LoraConfig
    from grpo.model import rollout as rollout_module
    from grpo.model.lora import wrap_lora

    policy = wrap_lora(tiny_model, LoraConfig(r=4))
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=6)  # every row decodes 6 steps

    def run() -> tuple[torch.Tensor, int]:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.profiler.profile() as prof:
            out = rollout(policy, tiny_tokenizer, prompts, seed=3, sampling=sampling)
        return out.completion_ids, sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")

    run()  # the first lean decode step of a kind also runs the model's forward (its check): not counted
    once, once_casts = run()
    monkeypatch.setattr(rollout_module, "cast_frozen_weights_once", lambda model: contextlib.nullcontext())
    every, every_casts = run()
    assert torch.equal(once, every)
    n_frozen_matrices = sum(1 for p in policy.parameters() if not p.requires_grad and p.dim() == 2)
    assert every_casts - once_casts >= 4 * n_frozen_matrices  # at least 4 decode steps saved their casts


@pytest.mark.parametrize("fast", ["auto", "off"])
def test_keeping_the_prefill_runs_the_very_passes_of_the_plain_shared_prefill(tiny_model, tiny_tokenizer, prompts,
                                                                             fast):
    """With ``segments``, the shared prefill runs one pass per segment over the whole prompts whether its graph
    is kept (``keep_prefill``, the update's reuse) or not: the same forwards on the same shapes, so the same
    keys, values and tokens. A bf16 product's rounding depends on its shape (a prompt pass one column
    shorter, or over both tasks at once, moves the keys: docs/performance.md, the prefill reuse), so a kept
    prefill computed otherwise than the plain one samples other tokens than ``model.fast_paths: off``.
    Asserted on the passes themselves: in fp32 the numbers agree either way."""
    calls: list[tuple] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append((tuple(ids.shape), ids.tolist()))

    prompts = [prompts[0], prompts[1], prompts[0][:-2] + prompts[1][-2:], prompts[1][:5] + prompts[0][-3:]]
    runs = {}
    hook = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for keep in (False, True):
            calls.clear()
            out, kept = sample_rollout(tiny_model, tiny_tokenizer, prompts, 2, SAMPLING,
                                       stop_ids(tiny_model, tiny_tokenizer), 3, shared_prefill=True,
                                       segments=["f", "h", "h", "f"], keep_prefill=keep, fast=FastPaths(fast))
            runs[keep] = (list(calls), out, kept)
    finally:
        hook.remove()
    (plain_calls, plain, none), (kept_calls, got, kept) = runs[False], runs[True]
    assert none == () and [p.index.tolist() for p in kept] == [[0, 3], [1, 2]]
    width = plain.prompt_ids.shape[1]
    assert plain_calls[:2] == kept_calls[:2] and [c[0] for c in plain_calls[:2]] == [(2, width), (2, width)]
    assert plain_calls == kept_calls, "the decode's passes after the prefill"
    assert torch.equal(got.sequences, plain.sequences)


def test_a_model_in_training_mode_rolls_out_without_dropout_and_stays_in_training_mode(tiny_model, tiny_tokenizer,
                                                                                      prompts):
    """The rollout samples from the policy itself, not a dropped-out copy of it: a training-mode model with
    attention dropout gives the tokens and the entropies it gives in eval mode (the entropies: a tiny model's
    greedy tokens may survive dropout), and is handed back in training mode."""
    import copy

    model = copy.deepcopy(tiny_model)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.eval()
    expected = rollout(model, tiny_tokenizer, prompts, greedy=True, with_entropy=True)
    model.train()
    for seed in (0, 1):
        torch.manual_seed(seed)  # dropout would draw from the global generator
        got = rollout(model, tiny_tokenizer, prompts, greedy=True, with_entropy=True)
        assert torch.equal(got.sequences, expected.sequences), seed
        assert torch.equal(got.entropy, expected.entropy), seed
    assert model.training


def test_top_k_of_one_is_a_processor_the_scorer_does_not_reproduce():
    from grpo.model.rollout import sampling_processors

    assert sampling_processors(SamplingConfig(top_k=1, min_new_tokens=0)) == ("top_k=1",)
    assert sampling_processors(SamplingConfig(min_new_tokens=0)) == ()
