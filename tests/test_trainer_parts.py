"""grpo/train/trainer.py's parts that need no training run (``tests/test_trainer.py`` trains, slow): which
prompts each process gets at each step and attempt, and the weight digest that proves the processes agree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
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


def _policy(model):
    from grpo.train.policy import Policy

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Policy(model, None, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)


def _run_cfg(tmp_path):
    return config_from_dict({"paths": {"runs_dir": str(tmp_path / "runs"), "models_dir": str(tmp_path / "models"),
                                       "metrics_dir": str(tmp_path / "metrics")}})


def test_the_summary_holds_the_first_and_last_reward_and_the_chosen_step(tmp_path, tiny_model, tiny_tokenizer):
    """metrics/grpo.json: ``reward_first`` is step 1's, ``reward`` the last step's, the timings are means over
    the steps, and ``selected_step`` is selection's choice (the last step when nothing was chosen)."""
    import json

    from grpo import paths
    from grpo.train.policy import Policy
    from grpo.train.trainer import save_final

    cfg = _run_cfg(tmp_path)
    policy = Policy(tiny_model, tiny_tokenizer, None, None, None)
    history = [{"step": s, "reward": 0.1 * s, "timing/rollout": float(s)} for s in (1, 2, 3)]
    save_final(cfg, policy, {"stage": "grpo"}, history, ["d"], chosen={"step": 2, "reason": "best"})
    summary = json.loads(paths.metrics_file(cfg, "grpo").read_text())
    assert summary["reward_first"] == pytest.approx(0.1) and summary["reward"] == pytest.approx(0.3)
    assert summary["steps"] == 3 and summary["timing/rollout"] == pytest.approx(2.0)
    assert summary["selected_step"] == 2 and summary["selection"] == {"step": 2, "reason": "best"}
    save_final(cfg, policy, {"stage": "grpo"}, history, ["d"])
    assert json.loads(paths.metrics_file(cfg, "grpo").read_text())["selected_step"] == 3


def _checkpointed(tmp_path, monkeypatch, stale: str | None):
    """A run folder with a checkpoint of step 4 (its torch RNG seeded 5), the lineage check answering
    ``stale``; returns the config and the checkpointed model."""
    from grpo import paths
    from grpo.train import checkpoint as ckpt
    from grpo.train.rng_state import capture_rng

    cfg, saved = _run_cfg(tmp_path), torch.nn.Linear(3, 2)
    policy = _policy(saved)
    torch.manual_seed(5)
    ckpt.save_checkpoint(paths.run_dir(cfg), 4, model=saved, optimizer=policy.optimizer, scheduler=policy.scheduler,
                         rng=capture_rng(), history=[{"step": 4, "reward": 0.5}], lineage={}, keep_last=2)
    monkeypatch.setattr("grpo.train.trainer.is_stale", lambda *args: stale)
    return cfg, saved


def test_resume_continues_a_current_checkpoint_with_its_random_state(tmp_path, monkeypatch):
    """The restored step, history and weights, and the torch RNG where the checkpoint left it."""
    from grpo.train.trainer import resume

    cfg, saved = _checkpointed(tmp_path, monkeypatch, None)
    expected = torch.rand(4)  # what the run drew next after the checkpoint
    torch.manual_seed(99)
    model = torch.nn.Linear(3, 2)
    assert resume(cfg, _policy(model)) == (4, [{"step": 4, "reward": 0.5}])
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)


def test_resume_starts_fresh_from_a_stale_checkpoint(tmp_path, monkeypatch):
    """A checkpoint other code or params wrote is never continued (DESIGN: lineage guard)."""
    from grpo.train.trainer import resume

    cfg, _ = _checkpointed(tmp_path, monkeypatch, "the code of grpo/train/step.py changed")
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    assert resume(cfg, _policy(model)) == (0, [])
    assert torch.equal(model.weight, before)


def test_one_process_whose_weights_differ_stops_the_run(monkeypatch):
    """Three processes, one of them out of step: two distinct digests are already a desync."""
    from grpo.train.trainer import TrainingError, check_in_sync

    model = torch.nn.Linear(3, 2)
    digest = weights_digest(model)
    monkeypatch.setattr("grpo.train.trainer.gather_object", lambda mine: [digest, digest, "0" * 64])
    with pytest.raises(TrainingError, match="weights differ"):
        check_in_sync(_policy(model), SimpleNamespace(num_processes=3))
    monkeypatch.setattr("grpo.train.trainer.gather_object", lambda mine: [digest] * 3)
    assert check_in_sync(_policy(model), SimpleNamespace(num_processes=3)) == [digest] * 3
