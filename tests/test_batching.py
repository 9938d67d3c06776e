"""grpo/core/batching.py: ids joined as generated (I3), cut at the prompt width (I4), masks from positions
(I5), the same log-probs alone and padded (I11)."""

from __future__ import annotations

import pytest
import torch

from grpo.core.batching import (
    completion_ids_from_generated,
    completion_mask,
    join_prompt_completion,
    left_pad,
    position_ids_from_mask,
    sft_batch,
)
from grpo.errors import GrpoError
from grpo.model import chat
from tests.weights import spread_weights

SHORT = "short"
LONG = (
    "a much longer prompt: two friends, a tall one and a short one, met at the station in the river "
    "town of Elbrook, which was founded by Mara Venn in 1821 and is known for glass"
)
MAX_NEW, MIN_NEW = 8, 3


def _prompts(tokenizer) -> list[list[int]]:
    return [chat.render_prompt(tokenizer, [{"role": "user", "content": text}]) for text in (SHORT, LONG)]


def _greedy(model, tokenizer, batch, max_new_tokens=MAX_NEW) -> torch.Tensor:
    """Real generate on a left-padded batch -> sequences [B, P + C]."""
    with torch.no_grad():
        return model.generate(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=MIN_NEW,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=chat.end_of_turn_ids(tokenizer),
        )


@pytest.fixture
def varied_model(tiny_model, tiny_tokenizer):
    """The tiny model with larger seeded weights and a louder <|eot_id|>.

    At its init scale the tiny model answers every prompt with one repeated token, which would let a
    wrong extraction pass; these weights make greedy text depend on the prompt and stop some rows early.
    """
    spread_weights(tiny_model, torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_model.get_input_embeddings().weight[tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")] *= 2
    return tiny_model


@pytest.fixture
def generated(varied_model, tiny_tokenizer):
    """(prompt ids per row, left-padded prompt batch, generated sequences [B, P + C]) for [SHORT, LONG]."""
    prompts = _prompts(tiny_tokenizer)
    batch = left_pad(prompts, tiny_tokenizer.pad_token_id)
    sequences = _greedy(varied_model, tiny_tokenizer, batch)
    completion = sequences[:, batch.input_ids.shape[1] :]
    # Preconditions of the tests' power: rows differ, and some row stops (then pads) before the end.
    assert not torch.equal(completion[0], completion[1])
    assert completion_mask(completion, chat.end_of_turn_ids(tiny_tokenizer)).truncated.tolist() == [
        False,
        True,
    ]
    return prompts, batch, sequences


# --------------------------------------------------------------------------- padding and positions


def test_left_pad_right_aligns_rows_and_marks_real_tokens():
    batch = left_pad([[5, 6], [7, 8, 9], []], pad_id=0)
    assert batch.input_ids.tolist() == [[0, 5, 6], [7, 8, 9], [0, 0, 0]]
    assert batch.attention_mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 0]]
    with pytest.raises(GrpoError, match="empty"):
        left_pad([], pad_id=0)


def test_position_ids_alone_equal_position_ids_padded():
    batch = left_pad([[5, 6], [7, 8, 9, 10]], pad_id=0)
    positions = position_ids_from_mask(batch.attention_mask)  # [2, 4]
    assert positions.shape == (2, 4)
    assert positions[0, 2:].tolist() == position_ids_from_mask(torch.ones(1, 2)).squeeze(0).tolist() == [0, 1]
    assert positions[1].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- I3, I4


def test_i3_joined_ids_are_exactly_prompt_plus_generated(generated, tiny_tokenizer):
    _, batch, sequences = generated
    width = batch.input_ids.shape[1]
    completion = completion_ids_from_generated(sequences, width)  # [B, C]
    masks = completion_mask(completion, chat.end_of_turn_ids(tiny_tokenizer))
    joined = join_prompt_completion(batch.input_ids, batch.attention_mask, completion, masks.mask)
    assert joined.input_ids.shape == joined.attention_mask.shape == sequences.shape
    assert torch.equal(joined.input_ids, sequences)
    assert torch.equal(joined.attention_mask[:, :width], batch.attention_mask)
    assert torch.equal(joined.attention_mask[:, width:], masks.mask.long())


def test_i4_left_padded_batch_extraction_contains_no_prompt_or_pad(generated, varied_model, tiny_tokenizer):
    prompts, batch, sequences = generated
    width = batch.input_ids.shape[1]
    eos_ids = chat.end_of_turn_ids(tiny_tokenizer)
    completion = completion_ids_from_generated(sequences, width)
    masks = completion_mask(completion, eos_ids)
    assert completion.shape == (2, sequences.shape[1] - width)
    assert torch.equal(sequences[:, :width], batch.input_ids)  # generate echoes the padded prompt
    for row, prompt in enumerate(prompts):
        # Each row's completion is what the model generates for that prompt alone: only generated tokens.
        alone = _greedy(varied_model, tiny_tokenizer, left_pad([prompt], tiny_tokenizer.pad_token_id))
        alone_completion = alone[0, len(prompt) :]
        n = int(masks.lengths[row])
        assert n >= MIN_NEW
        assert completion[row, :n].tolist() == alone_completion[:n].tolist()
        before_eos = completion[row, : n - 1] if not masks.truncated[row] else completion[row, :n]
        assert tiny_tokenizer.pad_token_id not in before_eos.tolist()


def test_i4_naive_non_pad_count_extraction_would_leak_prompt(generated, tiny_tokenizer):
    """The known bug: ``(ids != pad).sum()`` used as the prompt's end position."""
    prompts, batch, sequences = generated
    width = batch.input_ids.shape[1]
    naive_start = (batch.input_ids != tiny_tokenizer.pad_token_id).sum(dim=1)  # [B]
    short = 0
    assert int(naive_start[short]) < width - len(prompts[short])  # lands in the short row's padding
    naive = sequences[short, int(naive_start[short]) :].tolist()
    prompt = prompts[short]
    leaked = any(naive[i : i + len(prompt)] == prompt for i in range(len(naive) - len(prompt) + 1))
    assert leaked and SHORT in tiny_tokenizer.decode(naive)
    correct = completion_ids_from_generated(sequences, width)[short].tolist()
    assert naive[-len(correct) :] == correct and len(naive) > len(correct)
    # pad == <|eot_id|> also occurs inside prompts, so even the unpadded long row is miscounted.
    assert int(naive_start[1]) < width


# --------------------------------------------------------------------------- I5

EOT, PAD, A, B = 4, 4, 50, 51  # the tiny tokenizer's convention: pad == eot
I5_TABLE = [
    # completion ids            length  truncated   why
    ([A, B, EOT, PAD, PAD], 3, False),  # first eot included, later pads excluded
    ([EOT, PAD, PAD, PAD, PAD], 1, False),  # eos as first token: length 1, not 0
    ([A, B, A, B, A], 5, True),  # no eos: truncated, everything selected
    ([A, EOT, A, EOT, PAD], 2, False),  # only up to the FIRST eos
]


def test_i5_completion_mask_correct_under_left_padding_with_pad_equal_eot():
    """Table: each row's length is up to and including its first eot; pad == eot."""
    completion = torch.tensor([row for row, _, _ in I5_TABLE])  # [4, 5]
    masks = completion_mask(completion, [EOT])
    assert masks.mask.shape == (4, 5) and masks.mask.dtype == torch.bool
    assert masks.lengths.tolist() == [length for _, length, _ in I5_TABLE]
    assert masks.truncated.tolist() == [truncated for _, _, truncated in I5_TABLE]
    assert masks.mask.sum(dim=1).tolist() == masks.lengths.tolist()
    for row, (_, length, _) in enumerate(I5_TABLE):
        assert masks.mask[row].tolist() == [True] * length + [False] * (5 - length)
    # `id != pad` would have dropped the eot the model must learn to emit, and the eos-first row entirely.
    assert (completion != PAD).sum(dim=1).tolist() != masks.lengths.tolist()


def test_i5_completion_mask_with_pad_distinct_from_eos_keeps_pad_inside_text():
    """Qwen convention (pad != eos): a pad id before the eos is still part of the completion."""
    pad, eos = 7, 9
    masks = completion_mask(torch.tensor([[A, pad, B, eos, pad], [A, eos, 8, pad, pad]]), [eos, 8])
    assert masks.lengths.tolist() == [4, 2]
    assert masks.truncated.tolist() == [False, False]


def test_completion_mask_on_real_generation_matches_first_eos(generated, tiny_tokenizer):
    _, batch, sequences = generated
    eos_ids = chat.end_of_turn_ids(tiny_tokenizer)
    completion = completion_ids_from_generated(sequences, batch.input_ids.shape[1])
    masks = completion_mask(completion, eos_ids)
    for row in range(completion.shape[0]):
        ids = completion[row].tolist()
        first = next((i for i, t in enumerate(ids) if t in eos_ids), None)
        assert int(masks.lengths[row]) == (len(ids) if first is None else first + 1)
        assert bool(masks.truncated[row]) == (first is None)


def test_extraction_and_join_reject_mismatched_shapes():
    with pytest.raises(GrpoError, match="prompt width"):
        completion_ids_from_generated(torch.zeros(2, 3, dtype=torch.long), prompt_width=5)
    with pytest.raises(GrpoError, match="shape"):
        join_prompt_completion(
            torch.zeros(2, 3, dtype=torch.long),
            torch.ones(2, 3),
            torch.zeros(2, 4, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
        )


# --------------------------------------------------------------------------- I11


def _logits(model, input_ids, attention_mask) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
        ).logits


def test_i11_logits_alone_equal_padded_and_garbage_in_padding_changes_nothing(varied_model, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    short = torch.tensor([prompts[0]])
    n = short.shape[1]
    alone = _logits(varied_model, short, torch.ones_like(short))[0]  # [n, V]
    batch = left_pad(prompts, tiny_tokenizer.pad_token_id)
    padded = _logits(varied_model, batch.input_ids, batch.attention_mask)[0, -n:]  # [n, V]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    garbage_ids = batch.input_ids.clone()
    garbage_ids[batch.attention_mask == 0] = torch.arange(int((batch.attention_mask == 0).sum())) % 300 + 20
    garbage = _logits(varied_model, garbage_ids, batch.attention_mask)[0, -n:]
    assert not torch.equal(garbage_ids, batch.input_ids)
    torch.testing.assert_close(garbage, alone, atol=1e-5, rtol=1e-5)
    # The check has power: attending to the padding moves these logits far beyond the tolerance.
    leaky = _logits(varied_model, garbage_ids, torch.ones_like(batch.attention_mask))[0, -n:]
    assert (leaky - alone).abs().max() > 1e-2


# --------------------------------------------------------------------------- SFT


def test_sft_batch_left_pads_and_keeps_loss_mask_aligned(tiny_tokenizer):
    short = chat.render_sft(tiny_tokenizer, [{"role": "user", "content": SHORT}], "Answer: A")
    long = chat.render_sft(tiny_tokenizer, [{"role": "user", "content": LONG}], "I don't know.")
    batch = sft_batch([short, long], tiny_tokenizer.pad_token_id)
    width = len(long.ids)
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.loss_mask.shape == (2, width)
    assert batch.loss_mask.dtype == torch.bool
    for row, example in enumerate((short, long)):
        assert batch.input_ids[row, width - len(example.ids) :].tolist() == example.ids
        assert batch.loss_mask[row, width - len(example.ids) :].tolist() == example.loss_mask
        assert not batch.loss_mask[row, : width - len(example.ids)].any()
        supervised = [i for i, keep in zip(example.ids, example.loss_mask, strict=True) if keep]
        assert batch.input_ids[row][batch.loss_mask[row]].tolist() == supervised
    assert not (batch.loss_mask & (batch.attention_mask == 0)).any()
    with pytest.raises(GrpoError, match="loss-mask"):
        sft_batch([chat.SftExample([1, 2], [True])], 0)
