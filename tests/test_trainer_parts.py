"""grpo/train/trainer.py's parts that need no training run (``tests/test_trainer.py`` trains, slow): which
prompts each process gets at each step and attempt, and the weight digest that proves the processes agree."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from grpo.config import config_from_dict
from grpo.data.prepare import build_records
from grpo.data.select import split_by_task
from grpo.train.task_mix import shard
from grpo.train.trainer import _shard, weights_digest

CFG = config_from_dict({"data": {"n_train": 32, "n_eval": 4}, "grpo": {"prompts_per_step": 8}})


def _by_task():
    return split_by_task([r.model_dump(mode="json") for r in build_records(CFG)["train"]])


def test_each_process_takes_its_global_share_of_the_steps_prompts():
    """On several nodes the global index decides (the node-local one repeats on every node)."""
    by_task = _by_task()
    node_2_gpu_1 = SimpleNamespace(process_index=3, local_process_index=1, num_processes=4)
    mine = _shard(CFG, by_task, 5, 0, node_2_gpu_1)
    every = _shard(CFG, by_task, 5, 0, SimpleNamespace(process_index=0, local_process_index=0, num_processes=1))
    assert mine == shard(every, 3, 4) and mine != shard(every, 1, 4)


def test_a_resampling_attempt_draws_other_prompts_than_the_first_draw():
    by_task, one = _by_task(), SimpleNamespace(process_index=0, local_process_index=0, num_processes=1)
    ids = [[r["id"] for r in _shard(CFG, by_task, 5, attempt, one)] for attempt in (0, 1, 2)]
    assert ids[0] != ids[1] and ids[1] != ids[2]
    assert ids[0] == [r["id"] for r in _shard(CFG, by_task, 5, 0, one)]  # a function of (seed, step, attempt)


def test_the_weight_digest_reads_the_values_not_only_the_shapes():
    model = torch.nn.Linear(3, 2)
    before = weights_digest(model)
    with torch.no_grad():
        model.weight[0, 0] += 1e-3
    assert weights_digest(model) != before
