"""A GRPO step around the tiny model, for the tests of the step, its update and the checks that drive it."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from accelerate import Accelerator

from grpo.config import SamplingConfig, config_from_dict
from grpo.core.batching import left_pad
from grpo.data.prepare import build_records
from grpo.data.prompts import example_messages
from grpo.model.chat import render_prompt
from grpo.model.lora import wrap_lora
from grpo.model.rollout import rollout_from_sequences
from grpo.model.sampling import build_logits_processors
from grpo.train.dynamic_sampling import Draw
from grpo.train.policy import Policy
from grpo.train.step import StepResult, build_step, header_tokens, step_result
from grpo.train.step_types import Step
from grpo.train.update import update


def make_step(tiny_model, tiny_tokenizer, device: str = "cpu", fast_paths: str = "auto", **grpo) -> Step:
    """The step around the tiny model under a LoRA adapter, on ``device`` (``cuda``: the process's GPU), with
    ``model.fast_paths: fast_paths``."""
    cfg = config_from_dict({
        "grpo": {"group_size": 2, "sampling": {"max_new_tokens": 5}, **grpo},
        "model": {"lora": {"r": 2, "alpha": 4}, "fast_paths": fast_paths},
    })
    torch.manual_seed(0)
    model = wrap_lora(tiny_model.to(device), cfg.model.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return build_step(cfg, Policy(model, tiny_tokenizer, optimizer, scheduler, None), Accelerator(cpu=device == "cpu"))


def step_records() -> list[dict]:
    """Two fairness and two hallucination training records."""
    cfg = config_from_dict({"data": {"n_train": 16, "n_eval": 4}})
    train = [r.model_dump(mode="json") for r in build_records(cfg)["train"]]
    return [r for r in train if r["task"] == "fairness"][:2] + [r for r in train if r["task"] == "hallucination"][:2]


def with_advantages(sampled, advantages):
    return type(sampled)(sampled.rollout, sampled.records, sampled.rewards, advantages, sampled.stats,
                         prefills=sampled.prefills)


def combined_gradient(step, batch) -> torch.Tensor:
    update(step, batch)
    return torch.cat([p.grad.flatten() for p in step.model.parameters() if p.requires_grad])


def decode_cache_by_the_permutation(model, prefills, repeats):
    """``core.prefix.decode_cache`` with a slip: the kept rows mapped to the prompts by the permutation where its
    inverse is meant, so rows decode against other prompts' keys and values (where the order is not its own
    inverse: tasks interleaved as fairness, hallucination, hallucination, fairness)."""
    index = torch.cat([p.index for p in prefills])
    order = index.repeat_interleave(repeats)
    layers = [tuple(torch.cat([p.layers[i][kv] for p in prefills]).detach()[order][..., :-1, :] for kv in (0, 1))
              for i in range(len(prefills[0].layers))]
    return prefills[0].cache_class(layers, config=model.config)


STAGE_CONTEXT = "Context: Two friends, a tall one and a short one, met at the station."


def stage_result(tokenizer, eos_ids: list[int], completions: list[list[int]], elapsed: float = 1.0) -> StepResult:
    """What one training step of ``elapsed`` seconds hands the monitor when the decode loop generated
    ``completions`` (ids, the pad id after a stop token): the stage's cut (``rollout_from_sequences``) and
    ``step_result``."""
    record = {"task": "hallucination", "context": STAGE_CONTEXT, "question": "Who was late?", "answerable": True}
    n, width = len(completions), max(map(len, completions))
    prompt = left_pad([render_prompt(tokenizer, example_messages(record))] * n, tokenizer.pad_token_id)
    generated = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in completions])
    sampling = SamplingConfig()
    _, suppressor = build_logits_processors(prompt.input_ids.shape[1], eos_ids, sampling)
    rollout = rollout_from_sequences(tokenizer, prompt, torch.cat([prompt.input_ids, generated], dim=1),
                                     eos_ids, suppressor, n, sampling)
    step = SimpleNamespace(tokenizer=tokenizer, eos_ids=eos_ids, accelerator=SimpleNamespace(num_processes=1),
                          header_tokens=header_tokens(tokenizer, eos_ids),
                          end_of_turn_tokens=tokenizer.convert_ids_to_tokens(eos_ids))  # what build_step makes
    sampled = Draw(rollout, [record], torch.zeros(n), torch.zeros(n), {})
    return step_result(step, [record], sampled, {}, {"entropy": 1.0}, elapsed=elapsed)
