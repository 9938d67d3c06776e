"""Causal-LM training on rendered conversations: the loop the ``base`` pretraining and SFT share.

An example is ``render_sft``'s ids and loss mask (I1, I2): SFT keeps the mask on the assistant answer
and its end-of-turn token; pretraining (``grpo/train/pretrain.py``) sets it on every token. Both then
run ``train_sft``: AdamW, linear warmup and decay, gradient clipping, the accelerator's precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_linear_schedule_with_warmup

from grpo.config import OptimizerConfig
from grpo.core.batching import SftBatch, position_ids_from_mask, sft_batch
from grpo.core.losses import masked_mean
from grpo.data.prompts import example_messages, sft_target
from grpo.errors import GrpoError
from grpo.model.chat import SftExample, render_sft
from grpo.model.device import to_device
from grpo.model.precision import bf16_autocast


def conversation(record: dict, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict) -> SftExample:
    """A record as SFT trains on it: the prompt every stage renders, its target and end-of-turn (I1, I2)."""
    return render_sft(tokenizer, example_messages(record), sft_target(record), **template_kwargs)


def build_examples(
    records: Sequence[dict], tokenizer: PreTrainedTokenizerBase, max_length: int, template_kwargs: dict
) -> list[SftExample]:
    """Render every record; a conversation longer than ``max_length`` is an error, never cut."""
    examples = []
    for record in records:
        example = conversation(record, tokenizer, template_kwargs)
        if len(example.ids) > max_length:
            raise GrpoError(
                f"record {record.get('id')}: {len(example.ids)} tokens > sft.max_length={max_length}; "
                "raise sft.max_length or shorten the data (cutting would drop the end-of-turn token)"
            )
        examples.append(example)
    return examples


def sft_loss(model: PreTrainedModel, batch: SftBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy over the tokens the loss mask selects.

    batch.input_ids, attention_mask, loss_mask: [B, T]; position t predicts token t + 1.
    """
    logits = (
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
        )
        .logits[:, :-1]
        .float()
    )  # [B, T-1, V]
    targets = batch.input_ids[:, 1:]  # [B, T-1]
    mask = batch.loss_mask[:, 1:]  # [B, T-1] bool
    token_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    loss = masked_mean(token_loss, mask)
    with torch.no_grad():
        accuracy = masked_mean((logits.argmax(-1) == targets).float(), mask)
    return loss, {"loss": loss.item(), "token_accuracy": accuracy.item(), "tokens": int(mask.sum())}


def batch_loss(
    model: PreTrainedModel, examples: Sequence[SftExample], pad_id: int, device: torch.device, bf16: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """What the loop trains on for one batch of examples: their padded batch on ``device`` and its loss
    (``sft_loss``) under the stage's precision (bf16 autocast over fp32 master weights where it pays).
    The pre-flight gate drives this very function (I2: the stop token carries loss)."""
    batch = SftBatch(*to_device(device, *sft_batch(examples, pad_id)))
    with bf16_autocast(device, bf16):
        return sft_loss(model, batch)


LENGTH_GROUP_BATCHES = 50
"""Batches per length-sorted chunk of ``group_by_length``: long enough that batches pad little, short
enough that an epoch's order stays random."""


def epoch_batches(
    lengths: Sequence[int], batch_size: int, generator: torch.Generator, group_by_length: bool = False
) -> list[list[int]]:
    """One epoch's batches of example indices: a random permutation cut in order, or with
    ``group_by_length`` cut into chunks of ``LENGTH_GROUP_BATCHES`` batches, each chunk sorted by length
    into batches, and all the batches shuffled. Every index comes once either way."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    chunk = batch_size * LENGTH_GROUP_BATCHES
    batches = []
    for begin in range(0, len(order), chunk):
        part = sorted(order[begin : begin + chunk], key=lengths.__getitem__)
        batches.extend(part[start : start + batch_size] for start in range(0, len(part), batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def train_sft(
    model: PreTrainedModel,
    examples: Sequence[SftExample],
    pad_id: int,
    cfg: OptimizerConfig,
    seed: int,
    accelerator: Accelerator,
    progress: bool = True,
    desc: str = "sft",
) -> list[dict]:
    """AdamW over shuffled mini-batches on ``accelerator``'s device and precision (as GRPO); returns
    one metrics dict per optimizer step. ``desc`` labels the progress bar (``sft``, ``pretrain``)."""
    model.to(accelerator.device)
    generator = torch.Generator().manual_seed(seed)
    total = cfg.epochs * -(-len(examples) // cfg.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    history: list[dict] = []
    model.train()
    bar = tqdm(total=total, desc=desc, disable=not progress)
    lengths = [len(example.ids) for example in examples]
    for epoch in range(cfg.epochs):
        for rows in epoch_batches(lengths, cfg.batch_size, generator, cfg.group_by_length):
            loss, stats = batch_loss(model, [examples[i] for i in rows], pad_id, accelerator.device, cfg.bf16)
            if not torch.isfinite(loss):
                raise GrpoError(f"sft: loss is {loss.item()} at step {len(history) + 1}; lower sft.lr")
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            history.append(
                {
                    "step": len(history) + 1,
                    "epoch": epoch,
                    **stats,
                    "grad_norm": float(grad_norm),
                    "lr": scheduler.get_last_lr()[0],
                }
            )
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['token_accuracy']:.2f}", refresh=False)
    bar.close()
    model.eval()
    return history
