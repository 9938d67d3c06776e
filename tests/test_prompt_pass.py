"""grpo/model/fast/prompt_pass.py: evaluation's samples start from its greedy pass only where that pass holds
their own prefill's numbers bit for bit (``PromptPass``, ``PrefixWatch``, ``rows_independent``)."""

from __future__ import annotations

import pytest
import torch

from grpo.core.batching import left_pad
from grpo.core.prefix import prefilled_cache
from grpo.model import chat, kernels
from grpo.model.fast import prompt_pass as prompt_pass_module
from grpo.model.fast.decode import decode
from grpo.model.fast.prompt_pass import PromptPass, rows_independent
from grpo.model.precision import bf16_autocast
from grpo.model.sampling import build_logits_processors
from tests.test_decode import SAMPLINGS, G
from tests.weights import spread_weights


def _deeper_model(tiny_tokenizer, tiny_sizes):
    """The tiny model with three layers: a prompt's keys and values of the second and third layer follow the
    attention of the layers before them."""
    from grpo.model.tiny import build_tiny_model

    model = build_tiny_model(tiny_tokenizer, tiny_sizes.model_copy(update={"num_hidden_layers": 3}), seed=0)
    return spread_weights(model, torch.Generator().manual_seed(0)).eval()


def _pass_and_prefill(model, tokenizer, width, bf16, gen):
    """A greedy decode of 4 prompts left-padded to ``width`` with a ``PromptPass``, the cache it offers
    for G samples of them, and ``prefilled_cache``'s."""
    lengths = [width, *torch.randint(1, width + 1, (3,), generator=gen).tolist()]
    batch = left_pad([torch.randint(5, 300, (n,), generator=gen).tolist() for n in lengths], tokenizer.pad_token_id)
    sampling = SAMPLINGS["plain"].model_copy(update={"max_new_tokens": 2})
    prompt_pass = PromptPass()
    eos = chat.end_of_turn_ids(tokenizer)
    with torch.no_grad(), bf16_autocast(torch.device("cpu"), bf16, force=bf16):
        decode(model, batch.input_ids, batch.attention_mask, sampling, eos, tokenizer.pad_token_id,
               build_logits_processors(width, eos, sampling)[0], greedy=True, prompt_pass=prompt_pass)
        offered = prompt_pass.prefilled(model, batch.input_ids, batch.attention_mask, G)
        fresh = prefilled_cache(model, batch.input_ids, batch.attention_mask, G)
    return batch, prompt_pass, offered, fresh


def _same_cache(a, b) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers, strict=True))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_prompt_pass_offers_the_greedy_pass_only_as_the_prefills_very_cache(tiny_tokenizer, tiny_sizes, bf16):
    """Whatever the width, a cache ``PromptPass`` offers is ``prefilled_cache``'s, bit for bit: where the
    kernels move a width's numbers (in fp32 the CPU flash kernel does for many widths) it offers none; other
    prompts are never offered one."""
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    gen = torch.Generator().manual_seed(1)
    offered_widths = []
    for width in range(2, 41):
        batch, prompt_pass, offered, fresh = _pass_and_prefill(model, tiny_tokenizer, width, bf16, gen)
        assert prompt_pass.watch.calls == 3, "the watch saw every layer's attention of the pass"
        if offered is not None:
            assert _same_cache(offered, fresh), f"width {width}: the offered cache is not the prefill's"
            offered_widths.append(width)
        other = batch.input_ids.clone()
        other[0, -1] += 1
        assert prompt_pass.prefilled(model, other, batch.attention_mask, G) is None, "other prompts: no offer"
    assert len(offered_widths) >= 5, offered_widths


def test_prompt_pass_offers_nothing_where_the_kernel_moves_a_shorter_prompts_attention(
    tiny_tokenizer, tiny_sizes, monkeypatch
):
    """A kernel whose outputs follow the sequence length (here: a relative 1e-6 on odd lengths, below bf16's
    resolution, in the first layer only, so that the later layers' own attention agrees) makes a prompt's
    keys and values depend on its last column; the watch sees it and no cache is offered."""
    attend = kernels._attend
    monkeypatch.setattr(kernels, "_attend", lambda module, query, *args, **kwargs: (
        attend(module, query, *args, **kwargs) * (1 + 1e-6 * (query.shape[-2] % 2) * (module.layer_idx == 0))))
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    gen = torch.Generator().manual_seed(1)
    moved = 0
    for width in range(2, 12):
        _, prompt_pass, offered, fresh = _pass_and_prefill(model, tiny_tokenizer, width, False, gen)
        assert offered is None and not prompt_pass.watch.equal
        whole = prompt_pass.cache_class([(k[..., :-1, :], v[..., :-1, :]) for k, v in prompt_pass.layers])
        whole.batch_repeat_interleave(G)
        moved += not _same_cache(whole, fresh)
    assert moved == 10, "the shift moved every width's cache: a real difference to catch"


def test_prompt_pass_offers_nothing_where_a_linear_layers_rows_depend_on_the_row_count(
    tiny_tokenizer, tiny_sizes, monkeypatch
):
    """``rows_independent`` is asked before a cache is offered: with it saying no, no offer."""
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    gen = torch.Generator().manual_seed(1)
    for width in range(2, 41):
        batch, prompt_pass, offered, _ = _pass_and_prefill(model, tiny_tokenizer, width, False, gen)
        if offered is not None:
            break
    else:
        pytest.fail("no width was offered a cache")
    monkeypatch.setattr(prompt_pass_module, "rows_independent", lambda model, rows, fewer, **kwargs: False)
    assert prompt_pass.prefilled(model, batch.input_ids, batch.attention_mask, G) is None


def test_rows_independent_finds_a_linear_layer_whose_rows_depend_on_the_row_count(tiny_model):
    """The probe behind ``PromptPass`` tries every linear layer but the head: one whose product moves
    with the number of rows (here a scale by it) makes it say no, whichever layer it is; the head is left
    out (the prompt pass reuses no logits)."""

    class Batchwise(torch.nn.Linear):
        def forward(self, hidden):
            return super().forward(hidden) * (1 + 1e-3 * hidden.shape[0])

    assert rows_independent(tiny_model, 40, 36), "the tiny model's fp32 products of 36 and 40 rows"
    head = tiny_model.get_output_embeddings()
    head_class = type(head)
    head.__class__ = Batchwise
    assert rows_independent(tiny_model, 40, 36), "the head is not probed"
    head.__class__ = head_class
    for layer in (tiny_model.model.layers[1].mlp.down_proj, tiny_model.model.layers[0].self_attn.k_proj):
        plain = type(layer)
        layer.__class__ = Batchwise
        assert not rows_independent(tiny_model, 40, 36)
        layer.__class__ = plain


def _offered_pass(model, tokenizer):
    """The first width whose greedy pass is offered as the samples' cache, and the generator state that
    draws its prompts again."""
    gen = torch.Generator().manual_seed(1)
    for width in range(2, 41):
        state = gen.get_state()
        batch, prompt_pass, offered, _ = _pass_and_prefill(model, tokenizer, width, False, gen)
        if offered is not None:
            return width, state, batch, prompt_pass
    pytest.fail("no width was offered a cache")


def test_prompt_pass_offers_nothing_for_the_same_ids_under_another_mask(tiny_tokenizer, tiny_sizes):
    """The kept pass attended its own mask: the same ids with another column masked are other prompts."""
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    _, _, batch, prompt_pass = _offered_pass(model, tiny_tokenizer)
    mask = batch.attention_mask.clone()
    mask[0, 0] = 0
    assert prompt_pass.prefilled(model, batch.input_ids, mask, G) is None


def test_prompt_pass_offers_nothing_where_the_watch_missed_a_layers_attention(
    tiny_tokenizer, tiny_sizes, monkeypatch
):
    """The watch vouches only for the attention calls it saw: with the first layer's call of the pass unseen
    (an attention that does not go through the watched kernel), no cache is offered."""
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    width, state, _, _ = _offered_pass(model, tiny_tokenizer)
    seen = []
    watch = kernels.watch_attention

    def first_unseen(*args):
        if seen:
            watch(*args)
        seen.append(1)

    monkeypatch.setattr(kernels, "watch_attention", first_unseen)
    gen = torch.Generator()
    gen.set_state(state)
    _, prompt_pass, offered, _ = _pass_and_prefill(model, tiny_tokenizer, width, False, gen)
    assert prompt_pass.watch.calls == 2 and prompt_pass.watch.equal
    assert offered is None


def test_rows_independent_sees_a_row_move_in_its_last_bits(tiny_model):
    """Bit for bit, not within a tolerance: a product whose rows move by a few parts in a million with the
    row count (fp32 rounding of another blocking) is not row-independent."""

    class LastBits(torch.nn.Linear):
        def forward(self, hidden):
            return super().forward(hidden) * (1 + 1e-6 * hidden.shape[0])

    layer = tiny_model.model.layers[0].mlp.up_proj
    layer.__class__ = LastBits
    assert not rows_independent(tiny_model, 40, 36)


def test_rows_independent_asks_again_under_autocast(tiny_model):
    """A kernel's choice follows the dtype autocast multiplies in: an fp32 answer is not reused under bf16
    autocast, where this layer's rows depend on the row count."""

    class BatchwiseUnderAutocast(torch.nn.Linear):
        def forward(self, hidden):
            scale = 1 + 1e-2 * hidden.shape[0] * torch.is_autocast_enabled("cpu")
            return super().forward(hidden) * scale

    layer = tiny_model.model.layers[1].self_attn.v_proj
    layer.__class__ = BatchwiseUnderAutocast
    assert rows_independent(tiny_model, 40, 36)
    with bf16_autocast(torch.device("cpu"), True, force=True):
        assert not rows_independent(tiny_model, 40, 36)


def _attention_call(width: int, rows: int = 2):
    """Query, key, value [rows, 2 heads, width, 4] and a left-padded causal mask [rows, 1, width, width]
    (the second row's first column padding), as the kernel hands them to the watch."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 2, width, 4, generator=gen) for _ in range(3))
    allowed = torch.ones(width, width).tril().bool().expand(rows, 1, width, width).clone()
    allowed[1, :, :, 0] = False
    return q, k, v, torch.where(allowed, 0.0, float("-inf"))


def test_the_watch_compares_the_pass_with_its_prompts_one_column_shorter():
    """``watch_attention`` hands ``attend`` the queries, keys and values without their last column and the
    mask without its last query row and key column, and compares every output but the last query's."""
    q, k, v, mask = _attention_call(5)
    out = torch.randn(2, 5, 2, 4)
    seen = {}

    def attend(query, key, value, attention_mask):
        seen.update(query=query, key=key, value=value, mask=attention_mask)
        return out[:, : query.shape[-2]].clone()

    with prompt_pass_module.watch_prefix(prompt_pass_module.PrefixWatch()) as watch:
        prompt_pass_module.watch_attention(out, q, k, v, mask, attend)
    assert watch.calls == 1 and watch.equal
    assert torch.equal(seen["query"], q[..., :4, :]) and torch.equal(seen["key"], k[..., :4, :])
    assert torch.equal(seen["value"], v[..., :4, :])
    assert torch.equal(seen["mask"], mask[:, :, :4, :4]), "the shorter pass's own mask"
    moved = out.clone()
    moved[1, 3, 0, 2] += 1e-6  # a query but the last, in its last bits
    with prompt_pass_module.watch_prefix(prompt_pass_module.PrefixWatch()) as watch:
        prompt_pass_module.watch_attention(moved, q, k, v, mask, attend)
    assert watch.calls == 1 and not watch.equal


def test_the_watch_counts_whole_prompt_passes_and_distrusts_a_pass_without_a_full_mask():
    """Counted: calls whose queries are the whole sequence, of two columns or more (not a decode step, not a
    one-column prompt); outside ``watch_prefix`` nothing is compared. A pass without a mask, or with a mask
    that is no [B, 1, Q, K] slice-able one, is not vouched for."""
    never = lambda *args: pytest.fail("attend is not called")  # noqa: E731
    q, k, v, mask = _attention_call(5)
    out = torch.zeros(2, 5, 2, 4)
    prompt_pass_module.watch_attention(out, q, k, v, mask, never)  # outside a watch: attend not called
    with prompt_pass_module.watch_prefix(prompt_pass_module.PrefixWatch()) as watch:
        prompt_pass_module.watch_attention(out[:, -1:], q[..., -1:, :], k, v, mask[:, :, -1:], never)  # decode
        one = _attention_call(1)
        prompt_pass_module.watch_attention(out[:, :1], *one, never)  # a one-column prompt
    assert watch.calls == 0 and watch.equal
    for unmasked in (None, mask[:, 0]):
        with prompt_pass_module.watch_prefix(prompt_pass_module.PrefixWatch()) as watch:
            prompt_pass_module.watch_attention(out, q, k, v, unmasked, never)
        assert watch.calls == 1 and not watch.equal, unmasked


def test_prompt_pass_asks_whether_rows_are_independent_at_the_two_passes_row_counts(
    tiny_tokenizer, tiny_sizes, monkeypatch
):
    """The probe is asked about the products the two passes run: n prompts of every column (n × width rows)
    and of every column but the last (n × (width − 1) rows)."""
    model = _deeper_model(tiny_tokenizer, tiny_sizes)
    width, _, batch, prompt_pass = _offered_pass(model, tiny_tokenizer)
    asked = []
    probe = prompt_pass_module.rows_independent
    monkeypatch.setattr(
        prompt_pass_module, "rows_independent", lambda model, rows, fewer: asked.append((rows, fewer)) or probe(model, rows, fewer)
    )
    assert prompt_pass.prefilled(model, batch.input_ids, batch.attention_mask, G) is not None
    n = batch.input_ids.shape[0]
    assert asked == [(n * width, n * (width - 1))]
