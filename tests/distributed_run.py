"""Run under ``torchrun --nproc_per_node N -m tests.distributed_run <scenario> <out_dir>`` by
tests/test_distributed.py: the real step code on the tiny model, on 1 or 2 CPU processes (gloo).

``equal``: for every configuration of ``CONFIGS``, three steps on fixed global batches; each process
trains on its ``shard_indices`` share through ``prepare_batch``, ``update`` and ``step_result``; the
main process writes the weights and the step metrics to ``out_dir/<name>.*``. The completions of the
global batches are sampled once, in every process, from the initial policy with one seed, so the
1- and 2-process runs train on the same global data (generation itself is batched per process in a
real run, so its samples depend on the split). The advantages are fixed random numbers, so every
group carries a policy gradient.

``equal_fsdp``: the same with the policy sharded by FSDP2 (``grpo/train/sharding.py``) for the
configurations of ``FSDP_CONFIGS``; the test compares it with the unsharded one-process run.

``monitor``: process 1 alone has a completion holding a chat header; ``gather_step`` makes both
processes see it, so both stop (``trainer.watch``); a process that stopped alone would leave the
other waiting in the all-reduce below.
``nan``: process 1 alone has a NaN reward; every process must raise.
``batch_std <out_dir>``: each process's own rewards (other values and counts) through the step's
``collectives.global_reward_std`` with ``batch`` scaling, together and alone, and through ``draw`` on its own
prompts; each process writes all three.

``resume_state <params> <out_dir>``: the trainer's policy (sharded under ``ACCELERATE_USE_FSDP=true``)
resumed from the run's latest checkpoint, then its weights and optimizer state gathered whole, the
scheduler state, step and history written by the main process: what the resumed run starts from.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from grpo.config import TinyModelConfig, config_from_dict, load_config
from grpo.core.advantages import group_advantages
from grpo.data.prepare import build_records
from grpo.data.select import split_by_task
from grpo.health.monitor import Monitor, TrainingStopped
from grpo.model.device import make_accelerator
from grpo.model.lora import wrap_lora
from grpo.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo.train import checkpoint as ckpt
from grpo.train import step as step_module
from grpo.train.collectives import gather_step, global_reward_std
from grpo.train.policy import Policy, build_policy, frozen_copy
from grpo.train.sharding import full_tensor, is_sharded, policy_sharder, shard_model
from grpo.train.step import (
    Step,
    StepResult,
    build_step,
    draw,
    prepare_batch,
    raise_on_nonfinite_rewards,
    step_result,
)
from grpo.train.task_mix import sample_step, shard_indices
from grpo.train.trainer import resume, watch
from grpo.train.update import NonFiniteError, update
from tests.conftest import TINY_TEXTS

STEPS = 3
CONFIGS = {  # name -> (prompts per step, fairness_fraction, grpo overrides)
    "sum": (6, 0.5, {"multitask": {"mode": "sum"}}),
    "pcgrad": (6, 0.5, {"multitask": {"mode": "pcgrad"}}),
    "cagrad": (6, 0.5, {"multitask": {"mode": "cagrad"}}),
    "cagrad_reward_only": (6, 0.5, {"multitask": {"mode": "cagrad", "reward_only": True}}),
    "cagrad_low_memory": (6, 0.5, {"multitask": {"mode": "cagrad", "low_memory": True}}),
    "pcgrad_reward_only_low_memory": (6, 0.5, {"multitask": {"mode": "pcgrad", "reward_only": True,
                                                             "low_memory": True}}),
    "cagrad_grad_accum_2": (6, 0.5, {"multitask": {"mode": "cagrad"}, "grad_accum": 2}),
    "cagrad_fraction_0.625": (8, 0.625, {"multitask": {"mode": "cagrad"}}),
    "sum_token_mean_fraction_0.625_accum_2": (8, 0.625, {"multitask": {"mode": "sum"}, "grad_accum": 2,
                                                         "loss": {"loss_type": "token_mean"}}),
}
# Under FSDP: every mode, the shared graph (reward_only takes two backwards from one graph), micro-batches
# where a process has no rows of a task (placeholder backward), token_mean, and clipping that bites.
# ``cagrad_full_weights``: no LoRA, every weight trains and the KL reference is a frozen SFT copy (I9).
FSDP_CONFIGS = ("sum", "pcgrad", "cagrad", "cagrad_reward_only", "cagrad_grad_accum_2",
                "sum_token_mean_fraction_0.625_accum_2", "cagrad_clipped", "cagrad_full_weights")
CONFIGS["cagrad_clipped"] = (6, 0.5, {"multitask": {"mode": "cagrad"}, "max_grad_norm": 0.02})
CONFIGS["cagrad_full_weights"] = (6, 0.5, {"multitask": {"mode": "cagrad"}})
FULL_WEIGHTS = {"cagrad_full_weights"}


def tiny_base():
    """``(tokenizer, model)``: the small tokenizer and the 2-layer model every scenario starts from."""
    tokenizer = build_tiny_tokenizer(TINY_TEXTS * 4, vocab_size=400)
    sizes = TinyModelConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return tokenizer, build_tiny_model(tokenizer, sizes, seed=0).eval()


def make_step(accelerator: Accelerator, tokenizer, base, grpo: dict, fsdp: bool = False,
                 lora: bool = True) -> Step:
    """The tiny policy with a LoRA adapter drawn from one seed; SGD, so a wrong gradient SCALE shows in
    the weights (Adam would hide it), and no clipping for the same reason (except ``cagrad_clipped``).
    ``fsdp``: the policy sharded over the processes before the optimizer sees its parameters; ``lora``
    off: every weight trains against a frozen copy of ``base`` (I9), with a smaller step."""
    loss = {"beta": 0.04, "entropy_coef": 0.01} | grpo.get("loss", {})
    cfg = config_from_dict({
        "grpo": {"group_size": 4, "max_grad_norm": 1e6, "sampling": {"max_new_tokens": 6}} | grpo | {"loss": loss},
        "model": {"lora": {"r": 2, "alpha": 4, "enabled": lora}},
    })
    torch.manual_seed(0)
    model = wrap_lora(copy.deepcopy(base), cfg.model.lora) if lora else copy.deepcopy(base).requires_grad_(True)
    reference = None if lora else frozen_copy(base)
    if fsdp:
        model = shard_model(model, accelerator.num_processes, accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5 if lora else 0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return build_step(cfg, Policy(model, tokenizer, optimizer, scheduler, reference), accelerator)


def global_draws(step: Step, by_task: dict, n_prompts: int, fraction: float) -> list:
    """The global batch of each step: prompts, completions from the initial policy, fixed advantages."""
    draws = []
    for index in range(1, STEPS + 1):
        records = sample_step(by_task, n_prompts, fraction, seed=5, step=index)
        sampled = draw(step, records, seed=100 + index)
        advantages = torch.randn(len(sampled.rewards), generator=torch.Generator().manual_seed(index))
        draws.append(type(sampled)(sampled.rollout, sampled.records, sampled.rewards, advantages, sampled.stats))
    return draws


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole copies of the trainable weights (every process calls it: gathering a shard is a collective)."""
    return {k: full_tensor(v.detach()).clone().contiguous() for k, v in model.named_parameters() if v.requires_grad}


def run_equal(out: Path, fsdp: bool = False) -> None:
    accelerator = Accelerator(cpu=True)
    tokenizer, base = tiny_base()
    data = config_from_dict({"data": {"n_train": 32, "n_eval": 4}})
    by_task = split_by_task([r.model_dump(mode="json") for r in build_records(data)["train"]])
    cache: dict[tuple[int, float], list] = {}
    for name in FSDP_CONFIGS if fsdp else CONFIGS:
        n_prompts, fraction, grpo = CONFIGS[name]
        if (n_prompts, fraction) not in cache:  # sampled from the unsharded initial policy
            cache[n_prompts, fraction] = global_draws(make_step(accelerator, tokenizer, base, grpo),
                                                      by_task, n_prompts, fraction)
        step = make_step(accelerator, tokenizer, base, grpo, fsdp, lora=name not in FULL_WEIGHTS)
        initial = trainable_weights(step.model)
        history = []
        for index, whole in enumerate(cache[n_prompts, fraction], 1):
            mine = shard_indices([r["task"] for r in whole.records], accelerator.process_index,
                                 accelerator.num_processes)
            local = whole.select(mine)
            stats, _ = update(step, prepare_batch(step, local))
            result = step_result(step, local.records, local, local.stats, stats, elapsed=1.0)
            history.append({"step": index, **result.metrics, "n_completions": len(result.raw_texts)})
        weights = trainable_weights(step.model)
        if accelerator.is_main_process:
            history[-1]["max_update"] = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
            save_file(weights, str(out / f"{name}.safetensors"))
            (out / f"{name}.json").write_text(json.dumps(history))
        accelerator.wait_for_everyone()


def run_monitor() -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    header = "<|start_header_id|>"  # boundary_header stops when over 25% of completions hold one
    completion = f"Paris{header}assistant" if rank == 1 else "Paris"
    merged = gather_step(accelerator, {"completions/mean_length": 5.0}, {"groups": 1.0, "rows": 1.0}, [completion],
                         [f"question {rank}"])
    try:
        watch(Monitor(config_from_dict({}).monitor), 1, StepResult(*merged, [header], []))
    except TrainingStopped as stop:
        print(f"rank {rank} STOPPED: {str(stop).splitlines()[1]}", flush=True)
        return
    accelerator.reduce(torch.ones(3), "sum")  # the next step's gradient all-reduce
    print(f"rank {rank} CONTINUED", flush=True)


def run_nan() -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index

    rewards = torch.tensor([1.0, float("nan") if rank == 1 else 0.0])
    step = make_step(accelerator, *tiny_base(), {})
    try:
        raise_on_nonfinite_rewards(step, rewards, ["fairness", "fairness"], 1)
    except NonFiniteError as error:
        print(f"rank {rank} RAISED: {error}", flush=True)
        return
    accelerator.reduce(torch.ones(3), "sum")  # the update's all-reduce
    print(f"rank {rank} CONTINUED", flush=True)


def _spread_rewards(texts: list[str], records: list[dict], group_size: int, weights: dict) -> list[float]:
    """Seeded rewards in place of the scorer (a random tiny model earns -1 everywhere, so every
    advantage would be 0): values in {-1, 0, 1} times a per-process scale, so the processes' stds differ."""
    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(10 + rank)
    return ((torch.randint(0, 3, (len(texts),), generator=generator).float() - 1.0) * (1 + 2 * rank)).tolist()


def run_batch_std(out: Path) -> None:
    """Each process scores its own groups (different rewards, different counts); ``batch`` scaling must
    divide by the std of all of them, as one process holding every group would: through
    ``collectives.global_reward_std`` and through the step's ``draw`` (its rollouts real, its scorer ``_spread_rewards``)."""
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    generator = torch.Generator().manual_seed(rank)
    rewards = (torch.randint(0, 3, (4 * (2 + rank),), generator=generator).float() - 1.0) * (1 + 2 * rank)
    advantages, _ = group_advantages(rewards, 4, "batch", batch_std=global_reward_std(accelerator, rewards))
    local, _ = group_advantages(rewards, 4, "batch")
    step = make_step(accelerator, *tiny_base(), {"loss": {"scale_rewards": "batch"}})
    records = [r.model_dump(mode="json") for r in build_records(config_from_dict({"data": {"n_train": 8}}))["train"]]
    step_module.group_rewards = _spread_rewards
    drawn = draw(step, records[: 2 + rank], seed=7)
    save_file({"rewards": rewards, "advantages": advantages, "local": local, "draw_rewards": drawn.rewards,
               "draw_advantages": drawn.advantages}, str(out / f"rank{rank}.safetensors"))
    accelerator.wait_for_everyone()


def run_resume_state(params: Path, out: Path) -> None:
    cfg = load_config(params)
    accelerator = make_accelerator()
    policy = build_policy(cfg, accelerator.device, shard=policy_sharder(cfg, accelerator))
    step, history = resume(cfg, policy)
    state = ckpt.full_state(policy.model, policy.optimizer)  # every process: a gather under FSDP
    if accelerator.is_main_process:
        save_file(state.weights, str(out / "weights.safetensors"))
        torch.save(state.optimizer, out / "optimizer.pt")
        torch.save(policy.scheduler.state_dict(), out / "scheduler.pt")
        (out / "resumed.json").write_text(json.dumps({"step": step, "history": history,
                                                      "sharded": is_sharded(policy.model),
                                                      "processes": accelerator.num_processes}))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario in ("equal", "equal_fsdp"):
        run_equal(Path(sys.argv[2]), fsdp=scenario == "equal_fsdp")
    elif scenario == "monitor":
        run_monitor()
    elif scenario == "nan":
        run_nan()
    elif scenario == "batch_std":
        run_batch_std(Path(sys.argv[2]))
    elif scenario == "resume_state":
        run_resume_state(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: equal, equal_fsdp, monitor, nan, batch_std or resume_state")
