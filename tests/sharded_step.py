"""One SFT step of the tiny model wrapped with FSDP2 or DDP, for ``torchrun --nproc_per_node 2``.

Each process trains on its half of the batch; rank 0 writes how far the gathered weights are from
one unsharded process that took the same step on both halves (the mean of the two half losses,
which is what data parallelism averages). Run by tests/test_sharding.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from grpo.config import TinyModelConfig
from grpo.core.batching import sft_batch
from grpo.data.prompts import example_messages, sft_target
from grpo.model.chat import render_sft
from grpo.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo.train.causal_lm import sft_loss
from tests.conftest import TINY_TEXTS

SIZES = TinyModelConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
RECORDS = [
    {"task": "hallucination", "context": f"Town {i} was founded in 18{i}1.", "question": "When was it founded?",
     "answer": f"18{i}1" if i % 2 == 0 else None, "answerable": i % 2 == 0}
    for i in range(4)
]


def wrap(model: torch.nn.Module, strategy: str, world: int) -> torch.nn.Module:
    """FSDP2 as configs/accelerate/fsdp.yaml asks (one unit per decoder layer, reshard after forward), or DDP."""
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in inner.named_parameters()}


def step(model: torch.nn.Module, batches: list, lr: float = 1e-2) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = sum(sft_loss(model, batch)[0] for batch in batches) / len(batches)
    loss.backward()
    optimizer.step()


def main(strategy: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = build_tiny_tokenizer(TINY_TEXTS * 4, vocab_size=SIZES.vocab_size)
    examples = [render_sft(tokenizer, example_messages(r), sft_target(r)) for r in RECORDS]
    halves = [sft_batch(examples[i::world], tokenizer.pad_token_id) for i in range(world)]
    reference = build_tiny_model(tokenizer, SIZES, seed=0)
    step(reference, halves)
    model = wrap(build_tiny_model(tokenizer, SIZES, seed=0), strategy, world)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    step(model, [halves[rank]])
    got, want = full_weights(model), dict(reference.named_parameters())
    diff = max(float((got[n] - want[n]).abs().max()) for n in want)
    moved = max(float((got[n] - p).abs().max()) for n, p in
                build_tiny_model(tokenizer, SIZES, seed=0).named_parameters())
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"max_abs_diff": diff, "max_update": moved, "sharded": sharded, "world": world,
                       "names_match": sorted(got) == sorted(want)}, handle)
    dist.barrier()  # both ranks are done and rank 0's result is on disk
    # Exit without tearing the process group down: torch's ~ProcessGroupGloo can deadlock with its own
    # run-loop thread (the destructor holds the GIL and waits on the loop's mutex, the loop waits for the
    # GIL to drop a Python object of a finished work), which hung this script in 2 of 2 full test runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
