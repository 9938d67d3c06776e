"""What the probes of the embedded model (``fairness_reading``, ``copying``) share: a fresh model built as
the ``base`` stage builds it, before any pretraining, and how they report."""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from grpo.config import Config
from grpo.data.prepare import build_records
from grpo.model.modeling import build_tiny_model, build_tiny_tokenizer
from grpo.train.pretrain import record_texts


def fresh_embedded(cfg: Config) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A ``model.tiny`` model with random weights and the embedded tokenizer, trained on the training
    records as the base stage trains it (``record_texts``)."""
    torch.manual_seed(cfg.seed)
    tokenizer = build_tiny_tokenizer(record_texts(r.model_dump() for r in build_records(cfg)["train"]),
                                     cfg.model.tiny.vocab_size)
    return build_tiny_model(tokenizer, cfg.model.tiny, cfg.seed), tokenizer


def report(results: dict[str, Any], out: str | None) -> int:
    """Print ``results`` as JSON, and write them to ``out`` when given; the probe's exit status."""
    print(json.dumps(results, indent=2))
    if out:
        with open(out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0
