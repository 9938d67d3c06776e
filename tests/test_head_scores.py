"""grpo/core/head_scores.py: scoring in the LM head, chunk by chunk of positions, gives the full-logits
path's numbers (fp32, 1e-5): log-probs, entropy, logit statistics, losses, KL and gradients, for every loss
type and multitask mode, LoRA and full fine-tuning (tied and untied head), shared prefix on and off, kept
prefills; under bf16 autocast within the head's bf16 bounds (on CUDA: its split-bf16 product's). The update
through it: tests/test_head_scores_update.py; the head's products themselves: tests/test_precision_head.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.config import LoraConfig
from grpo.core import head_scores
from grpo.core.head_scores import (
    HeadRequest,
    HeadScoringError,
    chunk_positions,
    head_request,
    scores_in_head,
)
from grpo.core.logprobs import ScoringError, score_completions
from grpo.model.lora import wrap_lora
from grpo.model.precision import (
    Fp32Product,
    fp32_head,
)
from tests.steps import step_records
from tests.test_prefix import WIDTH, grouped_batch, moved_lora

TEMPERATURES = (0.7, 1.3)


@pytest.fixture(scope="module")
def records():
    return step_records()


def small_chunks(monkeypatch, positions: int, vocab: int) -> None:
    """Make the default chunk ``positions`` positions of a ``vocab`` head (many chunks on the tiny model)."""
    monkeypatch.setattr(head_scores, "LOGITS_CHUNK_BYTES", positions * 4 * vocab)
    monkeypatch.setattr("grpo.core.logprobs.LOGITS_CHUNK_BYTES", positions * 4 * vocab)


def untied(tiny_model) -> torch.nn.Module:
    """The tiny model's architecture with its own (untied) output head, every weight trainable."""
    config = LlamaConfig(**{**tiny_model.config.to_dict(), "tie_word_embeddings": False})
    torch.manual_seed(3)
    model = fp32_head(LlamaForCausalLM(config))
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    return model.train()


def untied_with_bias(tiny_model) -> torch.nn.Module:
    """``untied`` with a trainable bias on the output head (some architectures' heads have one)."""
    model = untied(tiny_model)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.linspace(-0.5, 0.5, head.out_features))
    return model


HEADS = {
    "lora": moved_lora,  # a frozen head: the backward from the forward's directions, no logits
    "full-tied": lambda m: m.train(),  # a trainable head tied to the embeddings: logits recomputed per chunk
    "full-untied": untied,
    "full-untied-bias": untied_with_bias,  # the bias's gradient too
}


def scored_and_grads(model, batch, temperature, full_logits, **kwargs):
    """Scores of ``batch`` and the gradient [P] of a loss on both log-probs and entropy."""
    input_ids, attention_mask, completion_mask = batch
    model.zero_grad(set_to_none=True)
    scored = score_completions(model, input_ids, attention_mask, WIDTH, temperature, full_logits=full_logits,
                               **kwargs)
    weights = torch.linspace(-1, 1, scored.logprobs.numel(), device=scored.logprobs.device).view_as(scored.logprobs)
    loss = (weights * scored.logprobs * completion_mask).sum() - 0.3 * (weights.flip(0) * scored.entropy).sum()
    loss.backward()
    return scored, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def assert_same_scores(got, want, atol=1e-5):
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=atol)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=atol)
    assert got.logits_stats.keys() == want.logits_stats.keys()
    for key, value in want.logits_stats.items():
        assert got.logits_stats[key] == pytest.approx(value, abs=atol), key


# --------------------------------------------------------------------------- the model's scoring


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("prefix", ["plain", "shared", "kept"])
@pytest.mark.parametrize("positions", [1, 3, None], ids=["chunk1", "chunk3", "one-chunk"])
def test_scoring_in_the_head_equals_the_full_logits_path(tiny_model, tiny_tokenizer, head, temperature, prefix,
                                                         positions):
    """Log-probs, entropy, statistics and the gradients of every trainable weight, chunk by chunk (one
    position, three, or all at once) against the full logits, within 1e-5."""
    from grpo.core.prefix import keep_prefills

    model = HEADS[head](tiny_model)
    batch = grouped_batch(tiny_tokenizer.pad_token_id)
    vocab = model.get_output_embeddings().out_features
    chunk = None if positions is None else positions * 4 * vocab
    assert scores_in_head(model)

    def kept():  # the rollout's prefill, with its graph, for each pass (a graph is used once)
        if prefix != "kept":
            return {}
        width = batch[0].shape[1] - WIDTH
        return {"prefills": keep_prefills(model, batch[0][::3, :width], batch[1][::3, :width], ["a", "b", "a"])}

    shared = prefix != "plain"
    want, want_grads = scored_and_grads(model, batch, temperature, True, shared_prefix=shared, **kept())
    got, got_grads = scored_and_grads(model, batch, temperature, False, shared_prefix=shared, chunk_bytes=chunk,
                                      **kept())
    assert got.logprobs.shape == got.entropy.shape == batch[2].shape
    assert_same_scores(got, want)
    assert want_grads.abs().max() > 1e-2
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_logprobs_only_are_the_scorings_log_probs_bit_for_bit(tiny_model, tiny_tokenizer, temperature):
    model = moved_lora(tiny_model)
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        full = score_completions(model, input_ids, attention_mask, WIDTH, temperature, shared_prefix=True)
        alone = score_completions(model, input_ids, attention_mask, WIDTH, temperature, shared_prefix=True,
                                  logprobs_only=True)
    assert torch.equal(alone.logprobs, full.logprobs) and alone.entropy is None and alone.logits_stats == {}


def test_chunks_are_sized_by_bytes_of_fp32_logits():
    assert chunk_positions(128_256, head_scores.LOGITS_CHUNK_BYTES) == 523  # Llama-3's vocabulary
    assert chunk_positions(400, 4 * 400 * 3) == 3
    assert chunk_positions(10**9, 1) == 1


def test_without_its_entropy_direction_a_gradient_on_the_entropy_raises(tiny_model, tiny_tokenizer):
    """``entropy_grad=False`` keeps no entropy direction: the log-probs' gradient is the same, a zero
    coefficient on the entropy is fine, and a real gradient on it raises, never a silent zero."""
    model = moved_lora(tiny_model)
    input_ids, attention_mask, completion_mask = grouped_batch(tiny_tokenizer.pad_token_id)

    def grads(entropy_grad: bool, entropy_coef: float):
        model.zero_grad(set_to_none=True)
        scored = score_completions(model, input_ids, attention_mask, WIDTH, 0.7, entropy_grad=entropy_grad)
        (-(scored.logprobs * completion_mask).sum() - entropy_coef * scored.entropy.sum()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    torch.testing.assert_close(grads(False, 0.0), grads(True, 0.0), rtol=0, atol=0)
    with pytest.raises(HeadScoringError, match="entropy_grad=True"):
        grads(False, 0.1)
    assert not torch.equal(grads(True, 0.1), grads(True, 0.0))


def test_a_model_that_changes_its_heads_output_is_refused(tiny_model, tiny_tokenizer):
    """A forward that rescales what its head returns (a logit scale, soft-capping) would turn the scores
    into nonsense: refused with the fix, and its full-logits scoring works."""
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    forward = tiny_model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    tiny_model.forward = scaled
    with pytest.raises(ScoringError, match="full_logits"):
        score_completions(tiny_model, input_ids, attention_mask, WIDTH, 1.0)
    assert score_completions(tiny_model, input_ids, attention_mask, WIDTH, 1.0, full_logits=True).entropy is not None


def test_a_head_that_does_not_serve_requests_is_scored_from_its_logits(tiny_model, tiny_tokenizer):
    """LoRA on the head itself: peft's wrapper would add its product to the scores, so the model is scored
    from its logits (the same numbers as the plain head's at a zero adapter)."""
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        plain = score_completions(tiny_model, input_ids, attention_mask, WIDTH, 0.7)
    wrapped = wrap_lora(copy.deepcopy(tiny_model), LoraConfig(r=2, alpha=4, target_modules=["v_proj", "lm_head"]))
    assert not scores_in_head(wrapped) and scores_in_head(tiny_model)
    with torch.no_grad():
        scored = score_completions(wrapped, input_ids, attention_mask, WIDTH, 0.7)
    assert_same_scores(scored, plain)


def test_a_request_must_cover_the_heads_positions(tiny_model):
    """The head scores ``[B, C + 1]`` positions' first C: a request of another width is an error, not a
    silent misalignment of ids and positions."""
    head = tiny_model.get_output_embeddings()
    request = HeadRequest(ids=torch.zeros(2, 4, dtype=torch.long), temperature=1.0, entropy=True,
                          entropy_grad=True, mask=None)
    with head_request(tiny_model, request), pytest.raises(HeadScoringError, match=r"\[B, C \+ 1\]"):
        head(torch.randn(2, 4, head.in_features))
    with head_request(tiny_model, request):
        assert head(torch.randn(2, 5, head.in_features)).shape == (2, 4, 2)
    assert head(torch.randn(2, 5, head.in_features)).shape == (2, 5, head.out_features)  # no request: logits


def test_a_forward_that_raises_leaves_no_request_on_the_head(tiny_model):
    """A forward that fails inside ``head_request`` (a refused width, out of memory) takes its request with
    it: the head's next forward without one (the rollout's sampling) returns logits, not stale scores."""
    head = tiny_model.get_output_embeddings()
    request = HeadRequest(ids=torch.zeros(2, 4, dtype=torch.long), temperature=1.0, entropy=True,
                          entropy_grad=True, mask=None)
    with pytest.raises(HeadScoringError, match=r"\[B, C \+ 1\]"), head_request(tiny_model, request):
        head(torch.randn(2, 4, head.in_features))
    assert head.head_request is None
    assert head(torch.randn(2, 5, head.in_features)).shape == (2, 5, head.out_features)


def test_the_statistics_of_no_position_are_zero_as_the_full_paths(tiny_model, tiny_tokenizer):
    """A batch whose completion positions are all masked out (every row ended at once) has statistics of
    nothing: 0.0 each, as ``logits_stats`` gives, never a NaN that the collapse monitor would read."""
    input_ids, attention_mask, _ = grouped_batch(tiny_tokenizer.pad_token_id)
    attention_mask = attention_mask.clone()
    attention_mask[:, -WIDTH:] = 0
    with torch.no_grad():
        got = score_completions(tiny_model, input_ids, attention_mask, WIDTH, 0.7)
        want = score_completions(tiny_model, input_ids, attention_mask, WIDTH, 0.7, full_logits=True)
    assert want.logits_stats == dict.fromkeys(head_scores.STATISTICS, 0.0)
    assert got.logits_stats == want.logits_stats


# --------------------------------------------------------------------------- the chunked function itself


def _float64_scores(hidden, weight, ids, temperature):
    log_probs = ((hidden.double() @ weight.double().T) / temperature).log_softmax(-1)
    return log_probs.gather(-1, ids[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_the_chunked_gradients_are_the_float64_softmaxs(trainable):
    """The forward's directions (frozen head) and the recomputed chunks (trainable head) against autograd
    through a float64 softmax, with logits large enough that some tokens are nearly certain."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=gen, dtype=torch.float64)
    weight = 2.0 * torch.randn(50, 16, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 50, (11,), generator=gen)
    g_logp, g_entropy = torch.randn(11, generator=gen), torch.randn(11, generator=gen)
    temperature = 0.8

    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(trainable)
    logp, entropy = _float64_scores(x, w, ids, temperature)
    (logp * g_logp.double() + entropy * g_entropy.double()).sum().backward()

    x32, w32 = hidden.float().requires_grad_(True), weight.float().requires_grad_(trainable)
    request = HeadRequest(ids=ids[None], temperature=temperature, entropy=True, entropy_grad=True, mask=None,
                          chunk_bytes=3 * 4 * 50)
    scores = head_scores.score_in_head(torch.cat([x32, x32[:1]])[None], w32, None, request,
                                       lambda w_, b_: Fp32Product(w_, b_, w_))[0]  # [11, 2]
    assert float((scores[:, 0].double() - logp).abs().max()) < 1e-5
    assert float((scores[:, 1].double() - entropy).abs().max()) < 1e-5
    (scores[:, 0] * g_logp + scores[:, 1] * g_entropy).sum().backward()
    scale = float(x.grad.abs().max())
    assert float((x32.grad.double() - x.grad).abs().max()) < 1e-5 * scale
    if trainable:
        assert float((w32.grad.double() - w.grad).abs().max()) < 1e-5 * float(w.grad.abs().max())


def test_confident_tokens_keep_their_gradient_under_a_bf16_backward():
    """Under autocast the directions go through the weight in bf16. ``(onehot - p) @ W`` rounds each term
    of a small vector; ``W[id] - p @ W`` would subtract two nearly equal bf16 products and keep nothing of
    a nearly certain token's gradient."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=gen)
    ids = torch.randint(0, 64, (8,), generator=gen)
    hidden = 0.4 * weight[ids] + 0.1 * torch.randn(8, 32, generator=gen)  # p(id) near 1
    x = hidden.double().requires_grad_(True)
    logp, _ = _float64_scores(x, weight, ids, 1.0)
    logp.sum().backward()
    assert float(logp.min()) > -1e-2  # nearly certain

    x32 = hidden.clone().requires_grad_(True)
    request = HeadRequest(ids=ids[None], temperature=1.0, entropy=False, entropy_grad=False, mask=None)
    scores = head_scores.score_in_head(torch.cat([x32, x32[:1]])[None], weight, None, request,
                                       lambda w_, b_: Fp32Product(w_, b_, w_.bfloat16()))[0]
    scores[:, 0].sum().backward()
    assert float((x32.grad.double() - x.grad).norm() / x.grad.norm()) < 1e-2
    probs = torch.softmax(hidden @ weight.T, dim=-1)
    cancelled = weight.bfloat16()[ids].float() - (probs.bfloat16() @ weight.bfloat16()).float()
    assert float((cancelled.double() - x.grad).norm() / x.grad.norm()) > 0.5  # what is avoided


def test_a_trainable_bias_beside_a_frozen_weight_gets_its_gradient():
    """A head whose weight is frozen and whose bias trains (peft's ``bias="all"``) takes the recomputed
    backward: the bias's gradient and the hidden state's are the float64 softmax's, not dropped by the
    frozen head's backward from the forward's directions (which has no gradient for the bias)."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(30, 16, generator=gen, dtype=torch.float64)
    bias = torch.randn(30, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 30, (7,), generator=gen)
    g_logp, g_entropy = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    temperature = 0.8

    x, b = hidden.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    log_probs = ((x @ weight.T + b) / temperature).log_softmax(-1)
    logp, entropy = log_probs.gather(-1, ids[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)
    (logp * g_logp.double() + entropy * g_entropy.double()).sum().backward()

    x32, b32 = hidden.float().requires_grad_(True), bias.float().requires_grad_(True)
    request = HeadRequest(ids=ids[None], temperature=temperature, entropy=True, entropy_grad=True, mask=None,
                          chunk_bytes=3 * 4 * 30)
    scores = head_scores.score_in_head(torch.cat([x32, x32[:1]])[None], weight.float(), b32, request,
                                       lambda w_, b_: Fp32Product(w_, b_, w_))[0]  # [7, 2]
    (scores[:, 0] * g_logp + scores[:, 1] * g_entropy).sum().backward()
    assert b32.grad is not None, "the bias's gradient was dropped"
    assert float((b32.grad.double() - b.grad).abs().max()) < 1e-5 * float(b.grad.abs().max())
    assert float((x32.grad.double() - x.grad).abs().max()) < 1e-5 * float(x.grad.abs().max())


def test_a_trainable_heads_backward_is_the_same_inside_the_callers_autocast():
    """The recomputed backward computes each chunk's logits with the forward's fp32 product whether or not
    the caller runs the backward inside its bf16 autocast: logits of tens rounded to bf16 there would move
    the probabilities, and so the gradients, by whole percents."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 16, generator=gen)
    weight = 3.0 * torch.randn(40, 16, generator=gen)  # logits of tens
    ids = torch.randint(0, 40, (9,), generator=gen)

    def grads(backward_inside: bool) -> torch.Tensor:
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        request = HeadRequest(ids=ids[None], temperature=0.7, entropy=True, entropy_grad=True, mask=None,
                              chunk_bytes=3 * 4 * 40)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = head_scores.score_in_head(torch.cat([x, x[:1]])[None], w, None, request,
                                               lambda w_, b_: Fp32Product(w_, b_, w_.bfloat16()))[0]
            loss = (scores[:, 0] - 0.3 * scores[:, 1]).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return torch.cat([x.grad.flatten(), w.grad.flatten()])

    outside = grads(False)
    assert outside.abs().max() > 1e-2
    torch.testing.assert_close(grads(True), outside, rtol=0, atol=0)


# --------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("head", ["lora", "full-tied"])
def test_bf16_scoring_in_the_head_is_the_full_paths_within_the_heads_bf16_bounds(tiny_model, tiny_tokenizer,
                                                                                  head, monkeypatch):
    """Under bf16 autocast both paths multiply the same hidden states in fp32 (the forward numbers agree to
    fp32), and both backwards run the head's products in bf16, rounding at different points: the
    gradients agree to bf16 (test_precision_head.py's bound for the head's bf16 backward)."""
    small_chunks(monkeypatch, 3, tiny_model.config.vocab_size)
    model = HEADS[head](tiny_model)
    batch = grouped_batch(tiny_tokenizer.pad_token_id)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = scored_and_grads(model, batch, 0.7, True, shared_prefix=True)
        got, got_grads = scored_and_grads(model, batch, 0.7, False, shared_prefix=True)
    assert_same_scores(got, want)
    scale = float(want_grads.abs().max())
    torch.testing.assert_close(got_grads, want_grads, rtol=2e-2, atol=2e-2 * scale)
    assert torch.nn.functional.cosine_similarity(got_grads, want_grads, dim=0) > 0.999


# --------------------------------------------------------------------------- on CUDA


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_under_bf16_the_head_scores_like_the_fp32_path_within_the_split_bound(tiny_model, tiny_tokenizer):
    """The scoring under CUDA bf16 autocast (bf16x3 in the head) against the full-logits path (the fp32
    product): log-probs and entropy within what a logit error of 2^-14 ``|h| |w|`` / T can move them
    (2x for a log-prob, 2 log V x for an entropy), the statistics too, and the LoRA gradients within the
    head's bf16 backward's bound (as on a CPU)."""
    device = torch.device("cuda")
    model = moved_lora(tiny_model).to(device)
    batch = tuple(t.to(device) for t in grouped_batch(tiny_tokenizer.pad_token_id))
    head = model.get_output_embeddings()
    heard = []
    hook = head.register_forward_pre_hook(lambda _, args: heard.append(args[0].detach()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, want_grads = scored_and_grads(model, batch, 0.7, True, shared_prefix=True)
        got, got_grads = scored_and_grads(model, batch, 0.7, False, shared_prefix=True)
    hook.remove()
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in heard]).double()
    error = 2**-14 * float((hidden.abs() @ head.weight.double().abs().T).max()) / 0.7
    assert float((got.logprobs - want.logprobs).abs().max()) <= 2 * error + 1e-5
    assert float((got.entropy - want.entropy).abs().max()) <= 2 * math.log(head.out_features) * error + 1e-5
    for key, value in want.logits_stats.items():
        assert got.logits_stats[key] == pytest.approx(value, abs=2 * error + 1e-5), key
    scale = float(want_grads.abs().max())
    torch.testing.assert_close(got_grads, want_grads, rtol=2e-2, atol=2e-2 * scale)
    assert torch.nn.functional.cosine_similarity(got_grads, want_grads, dim=0) > 0.999
