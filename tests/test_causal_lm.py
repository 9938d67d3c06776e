"""grpo/train/causal_lm.py: SFT examples from the one renderer, the masked loss, and the training loop."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator

from grpo.config import SftConfig, config_from_dict
from grpo.core.batching import sft_batch
from grpo.data.prepare import build_records
from grpo.errors import GrpoError
from grpo.train.causal_lm import (
    LENGTH_GROUP_BATCHES,
    batch_loss,
    build_examples,
    epoch_batches,
    sft_loss,
    train_sft,
)


@pytest.fixture(scope="module")
def records():
    cfg = config_from_dict({"data": {"n_train": 16, "n_eval": 4}})
    return [r.model_dump(mode="json") for r in build_records(cfg)["train"]][:6]


def test_examples_too_long_are_an_error_never_cut(records, tiny_tokenizer):
    examples = build_examples(records, tiny_tokenizer, 512, {})
    assert len(examples) == len(records) and all(e.ids[-1] == tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")
                                                  for e in examples)
    longest = max(len(e.ids) for e in examples)
    with pytest.raises(GrpoError, match=rf"tokens > sft.max_length={longest - 1}; raise sft.max_length"):
        build_examples(records, tiny_tokenizer, longest - 1, {})


def test_loss_is_the_mean_cross_entropy_of_the_supervised_tokens(records, tiny_model, tiny_tokenizer):
    batch = sft_batch(build_examples(records[:3], tiny_tokenizer, 512, {}), tiny_tokenizer.pad_token_id)
    loss, stats = sft_loss(tiny_model, batch)
    expected, count = 0.0, 0
    with torch.no_grad():
        for row in range(3):
            keep = batch.attention_mask[row].bool()
            ids, mask = batch.input_ids[row][keep], batch.loss_mask[row][keep]
            logp = torch.log_softmax(tiny_model(input_ids=ids[None]).logits[0, :-1].float(), dim=-1)
            picked = logp.gather(-1, ids[1:, None])[:, 0]
            expected -= float(picked[mask[1:]].sum())
            count += int(mask[1:].sum())
    assert stats["tokens"] == count
    assert loss.item() == pytest.approx(expected / count, rel=1e-5)


def test_loss_of_an_example_is_the_same_alone_and_inside_a_padded_batch(records, tiny_model, tiny_tokenizer):
    examples = build_examples(records[:3], tiny_tokenizer, 512, {})
    shortest = min(examples, key=lambda e: len(e.ids))
    alone, _ = sft_loss(tiny_model, sft_batch([shortest], tiny_tokenizer.pad_token_id))
    longer = [e for e in examples if len(e.ids) > len(shortest.ids)][0]
    padded = sft_batch([shortest, longer], tiny_tokenizer.pad_token_id)
    only_short = padded._replace(loss_mask=padded.loss_mask & torch.tensor([[True], [False]]))
    inside, _ = sft_loss(tiny_model, only_short)
    assert inside.item() == pytest.approx(alone.item(), abs=1e-5)


def test_training_lowers_the_loss_and_is_reproducible(records, tiny_model, tiny_tokenizer):
    examples = build_examples(records, tiny_tokenizer, 512, {})
    cfg = SftConfig(epochs=3, batch_size=4, lr=1e-2, warmup_ratio=0.0)
    twin = copy.deepcopy(tiny_model)
    history = train_sft(tiny_model, examples, tiny_tokenizer.pad_token_id, cfg, seed=1,
                        accelerator=Accelerator(cpu=True), progress=False)
    assert [h["step"] for h in history] == list(range(1, 3 * 2 + 1))  # 6 examples, batches of 4: 2 a epoch
    assert history[-1]["loss"] < history[0]["loss"]
    again = train_sft(twin, examples, tiny_tokenizer.pad_token_id, cfg, seed=1,
                      accelerator=Accelerator(cpu=True), progress=False)
    assert [h["loss"] for h in again] == [h["loss"] for h in history]
    assert all(torch.equal(a, b) for a, b in zip(tiny_model.parameters(), twin.parameters(), strict=True))


def _padded(lengths, batches):
    return sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)


def test_epoch_batches_are_a_plain_shuffle_unless_grouped_by_length():
    lengths = [10 + (i * 37) % 150 for i in range(2000)]
    plain = epoch_batches(lengths, 16, torch.Generator().manual_seed(3))
    order = torch.randperm(2000, generator=torch.Generator().manual_seed(3)).tolist()
    assert plain == [order[s : s + 16] for s in range(0, 2000, 16)], "off, the order SFT always drew"
    grouped = epoch_batches(lengths, 16, torch.Generator().manual_seed(3), group_by_length=True)
    assert sorted(i for batch in grouped for i in batch) == list(range(2000)), "every example once"
    assert len(grouped) == len(plain) and all(len(batch) <= 16 for batch in grouped)
    assert _padded(lengths, grouped) < 0.6 * _padded(lengths, plain)
    # Each batch comes from one chunk of the shuffled order, and the batches are shuffled across chunks.
    position = {index: p for p, index in enumerate(order)}
    chunks = [{position[i] // (16 * LENGTH_GROUP_BATCHES) for i in batch} for batch in grouped]
    assert all(len(chunk) == 1 for chunk in chunks)
    assert [c.pop() for c in chunks] != sorted(position[b[0]] // (16 * LENGTH_GROUP_BATCHES) for b in grouped)
    again = epoch_batches(lengths, 16, torch.Generator().manual_seed(3), group_by_length=True)
    assert again == grouped


def test_grouped_training_steps_every_example_and_lowers_the_loss(records, tiny_model, tiny_tokenizer):
    examples = build_examples(records, tiny_tokenizer, 512, {})
    cfg = SftConfig(epochs=3, batch_size=4, lr=1e-2, warmup_ratio=0.0, group_by_length=True)
    plain = train_sft(copy.deepcopy(tiny_model), examples, tiny_tokenizer.pad_token_id,
                      cfg.model_copy(update={"group_by_length": False}), seed=1,
                      accelerator=Accelerator(cpu=True), progress=False)
    history = train_sft(tiny_model, examples, tiny_tokenizer.pad_token_id, cfg, seed=1,
                        accelerator=Accelerator(cpu=True), progress=False)
    assert len(history) == 3 * 2 and history[-1]["loss"] < history[0]["loss"]
    for epoch in range(3):  # every supervised token once an epoch, in other batches than the plain order's
        assert sum(h["tokens"] for h in history if h["epoch"] == epoch) == \
            sum(h["tokens"] for h in plain if h["epoch"] == epoch)
    assert [h["tokens"] for h in history] != [h["tokens"] for h in plain]


def test_i2_the_loss_reaches_every_stop_token(records, tiny_model, tiny_tokenizer):
    """The batch the loop trains on (``batch_loss``): each conversation's stop token, in the last column of
    the left-padded batch, gets a gradient at the logits that predict it."""
    examples = build_examples(records, tiny_tokenizer, 512, {})
    caught = []

    def keep(module, inputs, output):
        output.retain_grad()
        caught.append(output)

    hook = tiny_model.get_output_embeddings().register_forward_hook(keep)
    loss, _ = batch_loss(tiny_model, examples, tiny_tokenizer.pad_token_id, torch.device("cpu"), bf16=False)
    loss.backward()
    hook.remove()
    stops = torch.tensor([example.ids[-1] for example in examples])
    at_stop = caught[0].grad[torch.arange(len(examples)), -2, stops]  # d loss / d logit of the stop token
    assert (at_stop < 0).all(), at_stop  # the loss falls as the stop token grows likelier


def test_i2_training_supervises_every_stop_token(records, tiny_model, tiny_tokenizer):
    """An epoch of the loop puts loss on every supervised token of every example, each stop token included:
    the tokens it reports add up to the examples' supervised tokens."""
    examples = build_examples(records, tiny_tokenizer, 512, {})
    cfg = SftConfig(epochs=1, batch_size=4, lr=1e-3)
    history = train_sft(copy.deepcopy(tiny_model), examples, tiny_tokenizer.pad_token_id, cfg, seed=0,
                        accelerator=Accelerator(cpu=True), progress=False)
    assert sum(h["tokens"] for h in history) == sum(sum(example.loss_mask) for example in examples)
