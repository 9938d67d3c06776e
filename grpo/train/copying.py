"""Copy texts: the pretraining text that teaches the embedded model to copy by content.

A copy text is ``<bos> s s`` for a sequence ``s`` of random tokens, the loss on the second copy only:
nothing but copying predicts it. At a fixed length of ``s`` "the token that many places back" does,
a rule of position; at any length the model has to find where the current token stood in the first
copy and copy what followed it (an induction head), which is what reading a year or a name it has
not seen from a context takes. ``pretrain.copy_texts`` mixes fresh ones into every epoch of the base
stage and ``pretrain.copy_warmup_steps`` trains on them alone first; ``benchmarks/copying.py`` probes
whether a model copies. README ("What was tried") gives what they measured.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.core.batching import SftBatch, sft_batch
from grpo.model.chat import SftExample, special_ids
from grpo.model.device import to_device
from grpo.train.supervised import sft_loss

LENGTHS = {"fixed": (30, 30), "variable": (10, 60)}
"""Token counts of ``s``: always 30, or drawn from 10 to 60."""


def copy_vocab(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id of ``tokenizer`` but its special ones (``special_ids``): what ``s`` is drawn from."""
    special = special_ids(tokenizer)
    return [token for token in range(len(tokenizer)) if token not in special]


def copy_texts(n: int, vocab: list[int], bos: int, length: str, seed: int) -> list[SftExample]:
    """``n`` texts ``<bos> s s``, the loss mask on the second ``s`` only; the same seed, the same texts."""
    rng = random.Random(seed)
    low, high = LENGTHS[length]
    texts = []
    for _ in range(n):
        size = rng.randint(low, high)
        sequence = [rng.choice(vocab) for _ in range(size)]
        texts.append(SftExample([bos, *sequence, *sequence], [False] * (size + 1) + [True] * size))
    return texts


@torch.no_grad()
def copy_accuracy(model: PreTrainedModel, texts: list[SftExample], pad_id: int) -> dict[str, float]:
    """Loss and next-token accuracy on the second copies of ``texts`` (guessing costs ln(vocabulary))."""
    model.eval()
    batch = SftBatch(*to_device(next(model.parameters()).device, *sft_batch(texts, pad_id)))
    _, stats = sft_loss(model, batch)
    return {"loss": round(stats["loss"], 3), "token_accuracy": round(stats["token_accuracy"], 3)}
