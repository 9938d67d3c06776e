"""Can the embedded model learn to copy a sequence it has seen, at a fixed or at any distance?

    python -m benchmarks.copying                                   # variable length, the base stage's settings
    python -m benchmarks.copying --length fixed --steps 300
    python -m benchmarks.copying --steps 2000 --set pretrain.lr=1e-3 --set pretrain.max_grad_norm=1000 \
        --set pretrain.warmup_ratio=0.02
    python -m benchmarks.copying --model models/base --steps 0   # does a trained model copy?

A probe, not a stage. It trains on copy texts (``grpo/train/copying.py``: ``<bos> s s`` of random
tokens, the loss on the second copy only). With ``--length fixed`` every ``s`` has 30 tokens, so a
rule of relative position copies it; with ``--length variable`` (10 to 60 tokens) only copying by
content does (an induction head). The model is a fresh ``model.tiny`` of params.yaml, trained by
``train_sft`` (the loop of the base and SFT stages) with ``pretrain.*`` (``--set`` overrides them); it
prints the loss on the second copy along the way and the final accuracy on fresh texts. Random
guessing costs ln(vocabulary) ≈ 6.4; copying, 0. With ``--model PATH`` (a saved model folder, e.g.
``models/base``) it starts from that model and its tokenizer instead, so ``--steps 0`` measures
whether a trained model copies. README ("What was tried") gives what it measured.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.embedded import fresh_embedded, report
from grpo.config import load_config
from grpo.model.device import make_accelerator
from grpo.model.modeling import load_model, load_tokenizer
from grpo.train.copying import LENGTHS, copy_accuracy, copy_texts, copy_vocab
from grpo.train.supervised import train_sft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="params override, e.g. pretrain.lr=1e-3 or model.tiny.num_hidden_layers=2")
    parser.add_argument("--length", choices=sorted(LENGTHS), default="variable")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps (one epoch of fresh texts)")
    parser.add_argument("--model", metavar="PATH",
                        help="start from this saved model and its tokenizer (e.g. models/base), not a fresh one")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    cfg = load_config(args.params, ["pretrain.epochs=1", *args.overrides])
    if args.model:
        model, tokenizer = load_model(args.model, cfg.model), load_tokenizer(args.model, cfg.model)
    else:
        model, tokenizer = fresh_embedded(cfg)
    vocab = copy_vocab(tokenizer)
    texts = copy_texts(args.steps * cfg.pretrain.batch_size, vocab, tokenizer.bos_token_id, args.length, cfg.seed)
    started = time.perf_counter()
    history = train_sft(model, texts, tokenizer.pad_token_id, cfg.pretrain, cfg.seed, make_accelerator(),
                        progress=False, desc="copying") if texts else []
    every = max(1, len(history) // 10)
    results = {
        "model": args.model or "fresh model.tiny", "length": args.length, "steps": len(history),
        "train_s": round(time.perf_counter() - started, 1),
        "loss_along_the_way": {step["step"]: round(step["loss"], 3) for step in history[every - 1 :: every]},
        "fresh_texts": copy_accuracy(model, copy_texts(64, vocab, tokenizer.bos_token_id, args.length,
                                                       cfg.seed + 1), tokenizer.pad_token_id),
    }
    return report(results, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
