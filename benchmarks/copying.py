"""Can the embedded model learn to copy a sequence it has seen, at a fixed or at any distance?

    python -m benchmarks.copying                                   # variable length, the base stage's settings
    python -m benchmarks.copying --length fixed --steps 300
    python -m benchmarks.copying --steps 2000 --set pretrain.lr=1e-3 --set pretrain.max_grad_norm=1000 \
        --set pretrain.warmup_ratio=0.02

A probe, not a stage. Each text is ``<bos> s s`` for a sequence ``s`` of random tokens of the embedded
tokenizer (no special tokens), and the loss is on the second copy only: nothing but copying predicts
it. With ``--length fixed`` every ``s`` has 30 tokens, so "the token 30 places back" does it, a rule
of relative position alone; with ``--length variable`` (10 to 60 tokens) the model has to find where
the current token stood in the first copy and copy what followed it (an induction head), which is what
reading a name, a year or the person a question names from a context takes. The model is a fresh
``model.tiny`` of params.yaml, trained by ``train_sft`` (the loop of the base and SFT stages) with
``pretrain.*`` (``--set`` overrides them); it prints the loss on the second copy along the way and the
final accuracy on fresh texts. Random guessing costs ln(vocabulary) ≈ 6.4; copying, 0. README ("What
was tried") gives what it measured.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.embedded import fresh_embedded, report
from grpo.config import load_config
from grpo.core.batching import sft_batch
from grpo.model.chat import SftExample
from grpo.model.device import make_accelerator
from grpo.train.supervised import sft_loss, train_sft

LENGTHS = {"fixed": (30, 30), "variable": (10, 60)}


def copy_texts(n: int, vocab: list[int], bos: int, length: str, seed: int) -> list[SftExample]:
    """``n`` texts ``<bos> s s``, the loss mask on the second ``s`` only."""
    rng = random.Random(seed)
    low, high = LENGTHS[length]
    texts = []
    for _ in range(n):
        size = rng.randint(low, high)
        sequence = [rng.choice(vocab) for _ in range(size)]
        texts.append(SftExample([bos, *sequence, *sequence], [False] * (size + 1) + [True] * size))
    return texts


@torch.no_grad()
def copy_accuracy(model, texts: list[SftExample], pad_id: int) -> dict[str, float]:
    """Loss and next-token accuracy on the second copies of ``texts``."""
    model.eval()
    _, stats = sft_loss(model, sft_batch(texts, pad_id))
    return {"loss": round(stats["loss"], 3), "token_accuracy": round(stats["token_accuracy"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="params override, e.g. pretrain.lr=1e-3 or model.tiny.num_hidden_layers=2")
    parser.add_argument("--length", choices=sorted(LENGTHS), default="variable")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps (one epoch of fresh texts)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    cfg = load_config(args.params, ["pretrain.epochs=1", *args.overrides])
    model, tokenizer = fresh_embedded(cfg)
    special = set(tokenizer.all_special_ids)
    vocab = [token for token in range(len(tokenizer)) if token not in special]
    texts = copy_texts(args.steps * cfg.pretrain.batch_size, vocab, tokenizer.bos_token_id, args.length, cfg.seed)
    started = time.perf_counter()
    history = train_sft(model, texts, tokenizer.pad_token_id, cfg.pretrain, cfg.seed, make_accelerator(),
                        progress=False, desc="copying")
    every = max(1, len(history) // 10)
    results = {
        "length": args.length, "steps": len(history), "train_s": round(time.perf_counter() - started, 1),
        "loss_along_the_way": {step["step"]: round(step["loss"], 3) for step in history[every - 1 :: every]},
        "fresh_texts": copy_accuracy(model, copy_texts(64, vocab, tokenizer.bos_token_id, args.length,
                                                       cfg.seed + 1), tokenizer.pad_token_id),
    }
    return report(results, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
