"""grpo/model/fast/decode.py: the decode loop samples exactly the tokens ``model.generate`` samples
(``grpo/model/generation.py``, the library path it stands in for)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from grpo.config import SamplingConfig, config_from_dict
from grpo.core.batching import completion_mask, join_prompt_completion, left_pad
from grpo.core.logprobs import score_completions
from grpo.core.prefix import prefilled_cache
from grpo.model import chat
from grpo.model.fast import FastPathWarning, multinomial
from grpo.model.fast import decode as decode_module
from grpo.model.fast.decode import ReservedLayer, decode, loop_mismatch, reserve_room
from grpo.model.fast.lean_step import LeanStep
from grpo.model.generation import generate_sequences, stack_records
from grpo.model.lora import wrap_lora
from grpo.model.precision import bf16_autocast
from grpo.model.sampling import build_logits_processors
from tests.weights import fill_adapter, spread_weights

TEXTS = ("short", "a tall one and a short one met at the station", "Who was late?",
         "The river town of Elbrook was founded by Mara Venn in 1821 and is known for glass.")
G = 3
SAMPLINGS = {
    "plain": SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12),
    "warped": SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12),
    "penalised": SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, min_new_tokens=3,
                                presence_penalty=0.8, frequency_penalty=0.4),
}


@pytest.fixture
def policy(tiny_model, tiny_tokenizer):
    return varied_policy(tiny_model, tiny_tokenizer)


def varied_policy(tiny_model, tiny_tokenizer):
    """The tiny model under a non-zero LoRA adapter, with weights that make completions vary and stop
    at different places (at its init scale it repeats one token)."""
    gen = torch.Generator().manual_seed(0)
    spread_weights(tiny_model, gen)
    with torch.no_grad():
        tiny_model.get_input_embeddings().weight[tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")] *= 3
    model = wrap_lora(tiny_model, config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    return fill_adapter(model, gen).eval()


def _prompts(tokenizer):
    ids = [chat.render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]
    return left_pad([p for p in ids for _ in range(G)], tokenizer.pad_token_id)


def _generate(model, tokenizer, batch, sampling, eos, greedy, seed, entropy=None, record=None, pad_id=None):
    """The library path: Hugging Face ``generate`` with a complete config and the same processors."""
    processors, _ = build_logits_processors(batch.input_ids.shape[1], eos, sampling)
    torch.manual_seed(seed)
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    return generate_sequences(model, batch.input_ids, batch.attention_mask, sampling, eos, pad_id,
                              processors, greedy=greedy, entropy=entropy, record=record)


def _decode(model, tokenizer, batch, sampling, eos, greedy, seed, prefilled, entropy=None, record=None, pad_id=None):
    processors, _ = build_logits_processors(batch.input_ids.shape[1], eos, sampling)
    cache = {}
    if prefilled:
        distinct = batch.input_ids[::G], batch.attention_mask[::G]
        cache = {"past_key_values": prefilled_cache(model, *distinct, G)}
    torch.manual_seed(seed)
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    return decode(model, batch.input_ids, batch.attention_mask, sampling, eos, pad_id,
                  processors, greedy=greedy, entropy=entropy, record=record, **cache)


@pytest.mark.parametrize("prefilled", [False, True], ids=["plain-prefill", "shared-prefill"])
@pytest.mark.parametrize("mode", [*SAMPLINGS, "greedy"])
def test_decode_samples_generates_tokens(policy, tiny_tokenizer, mode, prefilled, monkeypatch):
    """Sampled rows go through ``multinomial.multinomial_one``'s own draws (not its fallback to ``multinomial``)."""
    fast_draws = []
    exponentials = multinomial._exponentials
    monkeypatch.setattr(multinomial, "_exponentials", lambda shape: fast_draws.append(shape) or exponentials(shape))
    sampling = SAMPLINGS.get(mode, SAMPLINGS["plain"])
    greedy = mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    completions, stopped = set(), []
    for seed in (0, 1, 2):
        expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed)
        got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed, prefilled)
        assert got.shape == expected.shape
        assert torch.equal(got, expected), f"seed {seed}: decode and generate sampled different tokens"
        generated = expected[:, batch.input_ids.shape[1]:]  # [N, C]
        completions |= {tuple(row) for row in generated.tolist()}
        stopped += torch.isin(generated, torch.tensor(eos)).any(dim=1).tolist()
    assert len(completions) > 3, "completions vary (a real comparison)"
    assert bool(fast_draws) != greedy, "sampling drew through multinomial_one's exponentials, greedy decoding did not"
    if not greedy:
        assert any(stopped) and not all(stopped), "some rows stop early, others run on (pad after stop)"


@pytest.mark.parametrize("mode", ["plain", "greedy"])
def test_decode_keeps_a_drawn_stop_when_pad_is_another_token(policy, tiny_tokenizer, mode):
    """The tiny tokenizer pads with its stop token, where writing pad over a drawn stop changes nothing: here
    the pad id is an ordinary token, and each stopped row holds its stop, then pads, as ``generate``'s do."""
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    pad_id = next(i for i in range(len(tiny_tokenizer)) if i not in eos and i != tiny_tokenizer.pad_token_id)
    batch = _prompts(tiny_tokenizer)
    sampling, greedy = SAMPLINGS["plain"], mode == "greedy"
    expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, 0, pad_id=pad_id)
    got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, 0, False, pad_id=pad_id)
    assert torch.equal(got, expected), "decode and generate wrote different tokens with pad != stop"
    completions = got[:, batch.input_ids.shape[1]:]  # [N, C]
    stop = torch.isin(completions, torch.tensor(eos))  # [N, C]
    assert stop.any(), "some row drew its stop (a real comparison)"
    for row, stops in zip(completions, stop, strict=True):
        if stops.any():
            end = int(stops.int().argmax())
            assert (row[end + 1:] == pad_id).all(), "pad follows the drawn stop"


@pytest.mark.parametrize("mode", ["plain", "greedy"])
def test_decode_under_bf16_autocast_on_an_unpadded_batch_samples_generates_tokens(policy, tiny_tokenizer, mode):
    """Without a padded row ``generate`` passes no mask, and the attention runs without one (causal); under
    CPU bf16 autocast that is fp32 attention too (``kernels._attend``), so the tokens are the loop's, whose
    prepared mask takes the masked kernel."""
    sampling, greedy = SAMPLINGS["plain"], mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = left_pad([chat.render_prompt(tiny_tokenizer, [{"role": "user", "content": TEXTS[1]}])] * 6,
                     tiny_tokenizer.pad_token_id)
    assert bool(batch.attention_mask.all()), "no row is padded"
    completions = set()
    with bf16_autocast(torch.device("cpu"), True, force=True):
        for seed in range(6):
            expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed)
            got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed, prefilled=False)
            assert torch.equal(got, expected), f"seed {seed}: decode and generate sampled different tokens"
            completions |= {tuple(row) for row in expected[:, batch.input_ids.shape[1]:].tolist()}
    assert greedy or len(completions) > 3, "completions vary (a real comparison)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mode", [*SAMPLINGS, "greedy"])
def test_decode_on_cuda_samples_generates_tokens(policy, tiny_tokenizer, mode, bf16):
    """On a GPU the loop draws with ``torch.multinomial`` itself, from the GPU's generator, and the model's
    forward runs every step (no lean step): the tokens are still ``generate``'s, in fp32 and under bf16
    autocast, with the plain prefill and the shared one."""
    policy = policy.cuda()
    sampling = SAMPLINGS.get(mode, SAMPLINGS["plain"])
    greedy = mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    host = _prompts(tiny_tokenizer)
    batch = SimpleNamespace(input_ids=host.input_ids.cuda(), attention_mask=host.attention_mask.cuda())
    assert LeanStep.build(policy) is None
    completions = set()
    with bf16_autocast(torch.device("cuda"), bf16):
        for seed in (0, 1):
            expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed)
            for prefilled in (False, True):
                got = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, seed, prefilled)
                assert got.device.type == "cuda"
                assert torch.equal(got, expected), f"seed {seed}, prefilled {prefilled}: not generate's tokens"
            completions |= {tuple(row) for row in expected[:, batch.input_ids.shape[1]:].tolist()}
    assert len(completions) > 3, "completions vary (a real comparison)"


@pytest.mark.parametrize("prefilled", [False, True], ids=["plain-prefill", "shared-prefill"])
@pytest.mark.parametrize("mode", [*SAMPLINGS, "greedy"])
def test_decode_entropy_is_the_scorers_entropy_of_the_generated_tokens(policy, tiny_tokenizer, mode, prefilled):
    """The entropy the loop returns is ``score_completions``' entropy of the same ids: ``softmax(z / T)``
    at each completion position (warpers, penalties and EOS suppression left out, as the scorer leaves
    them), 0 after a row's stop token; the sampled tokens are those of a decode without it."""
    sampling = SAMPLINGS.get(mode, SAMPLINGS["plain"])
    greedy = mode == "greedy"
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    plain = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, 0, prefilled)
    columns = []
    sequences = _decode(policy, tiny_tokenizer, batch, sampling, eos, greedy, 0, prefilled, entropy=columns)
    assert torch.equal(sequences, plain)
    width = batch.input_ids.shape[1]
    completions = sequences[:, width:]  # [N, C]
    assert len(columns) == completions.shape[1] and all(c.shape == (len(plain),) for c in columns)
    entropy = torch.stack(columns, dim=1)  # [N, C]
    masks = completion_mask(completions, eos)
    joined = join_prompt_completion(batch.input_ids, batch.attention_mask, completions, masks.mask)
    with torch.no_grad():
        scored = score_completions(policy, joined.input_ids, joined.attention_mask, completions.shape[1],
                                   sampling.temperature)
    assert entropy.dtype == torch.float32
    assert not masks.mask.all() and (entropy[~masks.mask] == 0).all(), "0 after a row's stop token"
    inside = entropy[masks.mask]
    assert (inside > 0.05).all(), "a real distribution at every generated token"
    torch.testing.assert_close(inside, scored.entropy[masks.mask], rtol=0, atol=2e-5)


@pytest.mark.parametrize("prefilled", [False, True], ids=["plain-prefill", "shared-prefill"])
@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_decode_records_what_it_drew_as_generate_does(policy, tiny_tokenizer, mode, prefilled):
    """The loop's ``SamplerRecord`` is ``generate``'s (from its own logits and scores; bit for bit from the
    same prefill, within fp32 rounding from the shared one, whose logits differ in their last bits): the drawn
    ids are the generated ids (pad after a row's stop), the scored log-prob is ``score_completions``' of the
    same ids, the drawn log-prob is that of the warped, penalised distribution the token came from, and
    ``reshaped`` marks exactly the positions a penalty changed (top-k, top-p and EOS suppression only mask)."""
    sampling, eos = SAMPLINGS[mode], chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    library, loop = [], []
    expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, False, 0, record=library)
    got = _decode(policy, tiny_tokenizer, batch, sampling, eos, False, 0, prefilled, record=loop)
    assert torch.equal(got, expected) and len(loop) == len(library) == got.shape[1] - batch.input_ids.shape[1]
    record, reference = stack_records(loop), stack_records(library)
    for name, a, b in zip(record._fields, record, reference, strict=True):
        if prefilled and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"{name}: the loop's record is not generate's")
        else:
            assert torch.equal(a, b), f"{name}: the loop's record is not generate's"
    completions = got[:, batch.input_ids.shape[1]:]
    masks = completion_mask(completions, eos)
    assert torch.equal(record.ids, completions), "the recorded ids are the generated ids, pad after a stop"
    joined = join_prompt_completion(batch.input_ids, batch.attention_mask, completions, masks.mask)
    with torch.no_grad():
        scored = score_completions(policy, joined.input_ids, joined.attention_mask, completions.shape[1],
                                   sampling.temperature).logprobs
    torch.testing.assert_close(record.scored[masks.mask], scored[masks.mask], rtol=0, atol=2e-5)
    assert (record.scored[~masks.mask] == 0).all() and not record.reshaped[~masks.mask].any()
    drawn, plain = record.logprobs[masks.mask], record.scored[masks.mask]
    if mode == "plain":  # no processor after the first column (EOS suppression, min_new_tokens 1): the same numbers
        later = masks.mask.clone()
        later[:, 0] = False
        assert torch.equal(record.logprobs[later], record.scored[later])
    if mode == "penalised":
        assert record.reshaped[masks.mask].any(), "a penalty changed kept logits once a token repeated"
    else:
        assert not record.reshaped.any(), "top-k, top-p and EOS suppression only mask tokens out"
        assert (drawn >= plain - 1e-6).all(), "masking never lowers a kept token's share"
    if mode == "warped":
        assert (drawn > plain + 1e-3).any(), "top-k and top-p masking raise a kept token's share"


def test_decode_stops_at_max_new_tokens_and_after_every_row_stopped(policy, tiny_tokenizer):
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    sampling = SAMPLINGS["plain"].model_copy(update={"max_new_tokens": 2})
    assert _decode(policy, tiny_tokenizer, batch, sampling, eos, False, 0, False).shape[1] == batch.input_ids.shape[1] + 2
    forced = SAMPLINGS["plain"].model_copy(update={"max_new_tokens": 40})
    out = _decode(policy, tiny_tokenizer, batch, forced, eos, False, 0, False)
    completions = out[:, batch.input_ids.shape[1]:]  # [N, C]
    stop = torch.isin(completions, torch.tensor(eos))
    lengths = torch.where(stop.any(dim=1), stop.int().argmax(dim=1) + 1, forced.max_new_tokens)  # [N]
    assert completions.shape[1] == int(lengths.max()), "ends once every row stopped, or at max_new_tokens"


def test_reserved_layer_holds_the_dynamic_layers_values_without_a_copy_per_token():
    """``ReservedLayer`` returns what ``DynamicLayer`` returns at every update, writing into buffers
    reserved once (reallocated only when the room runs out or the rows change)."""
    gen = torch.Generator().manual_seed(0)
    plain, reserved = DynamicLayer(), DynamicLayer()
    first = [torch.randn(4, 2, 5, 3, generator=gen) for _ in range(2)]
    plain.update(*first)
    reserved.update(*first)
    reserve_room(SimpleNamespace(layers=[reserved]), 3)
    assert type(reserved) is ReservedLayer
    fresh = ReservedLayer()  # one that starts empty, never a DynamicLayer first
    fresh.reserve = 3
    fresh.update(*first)
    buffers = []
    for width in (1, 1, 1, 1, 2):  # the first update takes room for 3 more: 4 tokens fit, the fifth reallocates
        states = [torch.randn(4, 2, width, 3, generator=gen) for _ in range(2)]
        expected, got, started = plain.update(*states), reserved.update(*states), fresh.update(*states)
        assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
        assert all(torch.equal(e, g) for e, g in zip(expected, started, strict=True))
        buffers.append(reserved._buffers[0].data_ptr())
    assert buffers[0] == buffers[1] == buffers[2] == buffers[3] != buffers[4]
    assert reserved.get_seq_length() == plain.get_seq_length() == fresh.get_seq_length() == 11
    reserved.rewind(7)  # the lean step's check: forget the last columns, keep the first 7 of each
    assert reserved.get_seq_length() == 7
    assert torch.equal(reserved.keys, plain.keys[..., :7, :]) and torch.equal(reserved.values, plain.values[..., :7, :])


def test_generate_ignores_the_checkpoints_own_sampling_defaults(policy, tiny_tokenizer):
    """A checkpoint's generation_config (Qwen's repetition_penalty 1.05, top_k 20, ...) never fills the fields
    the project leaves at their defaults: the library path samples exactly as the scorer assumes (I10)."""
    batch, eos = _prompts(tiny_tokenizer), chat.end_of_turn_ids(tiny_tokenizer)
    plain = _generate(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, greedy=True, seed=0)
    config = policy.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size = 50.0, 1  # would change any repeating greedy reply
    assert torch.equal(_generate(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, greedy=True, seed=0), plain)


def test_decode_with_top_k_one_samples_generates_greedy_tokens(policy, tiny_tokenizer):
    """``top_k: 1`` keeps one token per step: ``generate`` warps with it, and so does the loop (a real filter,
    not a no-op), so the sampled rows are the greedy ones whatever the seed."""
    sampling = SAMPLINGS["plain"].model_copy(update={"top_k": 1})
    eos = chat.end_of_turn_ids(tiny_tokenizer)
    batch = _prompts(tiny_tokenizer)
    greedy = _generate(policy, tiny_tokenizer, batch, SAMPLINGS["plain"], eos, True, 0)
    for seed in (0, 1):
        expected = _generate(policy, tiny_tokenizer, batch, sampling, eos, False, seed)
        got = _decode(policy, tiny_tokenizer, batch, sampling, eos, False, seed, prefilled=False)
        assert torch.equal(got, expected) and torch.equal(got, greedy)


@pytest.fixture
def fresh_loop_check():
    """``loop_mismatch`` runs again in this test and again after it (it is memoised per process)."""
    loop_mismatch.cache_clear()
    yield loop_mismatch
    loop_mismatch.cache_clear()


def test_the_loops_self_check_leaves_the_generator_alone(fresh_loop_check):
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert fresh_loop_check() is None
    assert torch.equal(torch.get_rng_state(), before)


def _without_warpers(real):
    """Sampling without its temperature, top-k and top-p: greedy decoding unchanged."""
    return lambda sampling, greedy: real(sampling, greedy) if greedy else LogitsProcessorList()


def _greedy_pushed(real):
    """Greedy decoding pushed to token 5 at every step: sampling unchanged."""
    def push(ids, scores):
        return scores.index_fill(-1, torch.tensor([5]), 1e4)

    return lambda sampling, greedy: LogitsProcessorList([push]) if greedy else real(sampling, greedy)


@pytest.mark.parametrize(("fault", "mode"), [(_without_warpers, "warped sampling"), (_greedy_pushed, "greedy")])
def test_a_loop_wrong_in_one_mode_fails_the_self_check_naming_it(fresh_loop_check, monkeypatch, fault, mode):
    """The self-check runs warped sampling and greedy decoding each: a loop wrong in only one of them falls
    back, and the reason names that one."""
    monkeypatch.setattr(decode_module, "warpers", fault(decode_module.warpers))
    with pytest.warns(FastPathWarning, match="'decode loop' fell back to model.generate"):
        reason = fresh_loop_check()
    assert reason == f"it sampled other tokens than generate ({mode})"


def test_a_loop_that_attends_the_padding_fails_the_self_check(fresh_loop_check, monkeypatch):
    """The self-check's prompts are left-padded: a loop whose mask lets the queries see the pad columns
    samples other tokens than ``generate`` there, and falls back with a warning."""
    prepared = decode_module.model_attention_mask
    monkeypatch.setattr(decode_module, "model_attention_mask",
                        lambda model, mask, width: prepared(model, torch.ones_like(mask), width))
    with pytest.warns(FastPathWarning, match="'decode loop' fell back to model.generate"):
        assert fresh_loop_check() is not None
