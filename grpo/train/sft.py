"""Stage ``sft``: supervised fine-tuning with the one chat renderer (I1, I2).

Each training record becomes ``render_sft(prompt messages, target)``: the prompt ids are exactly the
ids GRPO will sample from, and only the assistant answer plus its end-of-turn token carry loss, so
the model learns to stop (the loop is ``grpo/train/causal_lm.py``'s). Full fine-tuning by default (the tiny model); with ``sft.lora`` a LoRA
adapter is trained and merged, so the saved SFT weights are the policy GRPO's reference is (I9).
"""

from __future__ import annotations

import json
import time

import torch

from grpo import paths
from grpo.config import Config
from grpo.data.select import train_records
from grpo.files import write_atomically
from grpo.locks import writes
from grpo.model.device import make_accelerator
from grpo.model.loading import save_model
from grpo.model.lora import wrap_lora
from grpo.model.precision import apply_memory_settings
from grpo.model.stage_models import load_base
from grpo.provenance.lineage import make_lineage, write_lineage
from grpo.train.causal_lm import build_examples, train_sft


@writes(lambda cfg: paths.model_dir(cfg, "sft"))
def run(cfg: Config) -> int:
    model, tokenizer = load_base(cfg)
    model = apply_memory_settings(model, cfg.model)
    records = train_records(cfg, "sft")
    examples = build_examples(records, tokenizer, cfg.sft.max_length, cfg.model.chat_template_kwargs)
    if cfg.sft.lora:
        torch.manual_seed(cfg.seed)  # LoRA init draws from the global generator
        model = wrap_lora(model, cfg.model.lora)
    started = time.perf_counter()
    history = train_sft(model, examples, tokenizer.pad_token_id, cfg.sft, cfg.seed, make_accelerator())
    wall = time.perf_counter() - started
    if cfg.sft.lora:
        model = model.merge_and_unload()
    out = paths.model_dir(cfg, "sft")
    save_model(model.cpu(), tokenizer, out)
    write_lineage(out, make_lineage("sft", cfg, paths.stage_inputs(cfg, "sft")))
    summary = {
        "loss_first": history[0]["loss"],
        "loss_final": history[-1]["loss"],
        "token_accuracy_final": history[-1]["token_accuracy"],
        "steps": len(history),
        "examples": len(examples),
        "wall_time_s": round(wall, 2),
    }
    write_atomically(
        {
            paths.metrics_file(cfg, "sft"): json.dumps(summary, indent=2) + "\n",
            paths.metrics_file(cfg, "sft_history"): json.dumps(history) + "\n",
        }
    )
    print(
        f"sft: {len(history)} steps in {wall:.1f}s, loss {summary['loss_first']:.3f} -> "
        f"{summary['loss_final']:.3f}; model written to {out}"
    )
    return 0
