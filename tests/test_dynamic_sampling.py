"""grpo/train/dynamic_sampling.py and the step's ``sample``: zero-variance groups kept, filtered, or replaced by
fresh prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo.config import config_from_dict
from grpo.core.timing import PhaseTimer
from grpo.model.rollout import Rollout
from grpo.train import step as step_module
from grpo.train.dynamic_sampling import Draw

G = 2


def fake_rollout(n_groups: int, completion_width: int) -> Rollout:
    n = n_groups * G
    return Rollout(
        prompt_ids=torch.arange(n * 3).view(n, 3), prompt_mask=torch.ones(n, 3, dtype=torch.long),
        sequences=torch.cat([torch.arange(n * 3).view(n, 3), torch.ones(n, completion_width, dtype=torch.long)], 1),
        completion_ids=torch.ones(n, completion_width, dtype=torch.long),
        completion_mask=torch.ones(n, completion_width, dtype=torch.bool),
        texts=[f"t{i}" for i in range(n)], raw_texts=[f"t{i}" for i in range(n)],
        lengths=torch.full((n,), completion_width), truncated=torch.zeros(n, dtype=torch.bool),
        eos_suppressed_frac=0.0, group_size=G, temperature=1.0, processors=(),
    )


def make_draw(names: list[str], rewards: list[float], width: int = 4) -> Draw:
    r = torch.tensor(rewards, dtype=torch.float32)
    advantages = (r.view(-1, G) - r.view(-1, G).mean(1, keepdim=True)).flatten()
    return Draw(fake_rollout(len(names), width), [{"id": n} for n in names], r, advantages,
                {"frac_reward_zero_std": sum(rewards[i] == rewards[i + 1] for i in range(0, len(rewards), G))
                 / len(names)})


@pytest.fixture
def sample_groups(monkeypatch):
    """``step.sample`` with its draws replaced: the ``attempt``-th draw returns ``table[attempt]``."""

    def run(table: dict[int, Draw], records, more_records, mode, max_resample, pad_id):
        calls = iter(sorted(table))
        monkeypatch.setattr(step_module, "draw", lambda step, _records, seed, timer: table[next(calls)])
        cfg = config_from_dict({"grpo": {"dynamic_sampling": mode, "max_resample": max_resample}})
        stub = SimpleNamespace(cfg=cfg, accelerator=SimpleNamespace(process_index=0),
                               tokenizer=SimpleNamespace(pad_token_id=pad_id))
        return step_module.sample(stub, records, 1, more_records, PhaseTimer())

    return run


def test_none_keeps_every_group(sample_groups):
    first = make_draw(["a", "b"], [1, 1, 0, 1])
    sampled, stats = sample_groups({0: first}, [{}, {}], lambda _: [], "none", 0, pad_id=0)
    assert sampled is first and stats["frac_reward_zero_std"] == 0.5


def test_filter_drops_zero_variance_groups_but_reports_the_first_draw(sample_groups):
    first = make_draw(["a", "b", "c"], [1, 1, 0, 1, -1, -1])
    sampled, stats = sample_groups({0: first}, [{}] * 3, lambda _: [], "filter", 5, pad_id=0)
    assert [r["id"] for r in sampled.records] == ["b"]
    assert sampled.rewards.tolist() == [0, 1]
    assert stats["frac_reward_zero_std"] == 2 / 3  # the deadlock signal is not hidden by filtering
    assert stats["dynamic/kept_groups"] == 1 and stats["dynamic/draws"] == 1


def test_resample_refills_the_batch_from_fresh_prompts_with_other_widths(sample_groups):
    first = make_draw(["a", "b"], [1, 1, 0, 1], width=3)
    second = make_draw(["c", "d"], [0, 1, 2, 2], width=6)
    sampled, stats = sample_groups({0: first, 1: second}, [{}, {}], lambda a: [{}, {}], "resample",
                                   2, pad_id=9)
    assert [r["id"] for r in sampled.records] == ["b", "c"]
    assert sampled.rollout.completion_ids.shape == (4, 6)
    # The narrower draw is right-padded with masked positions: the mask, not the pad id, tells.
    assert sampled.rollout.completion_mask[:2, 3:].sum() == 0
    assert sampled.rollout.completion_ids[:2, 3:].eq(9).all()
    assert torch.equal(sampled.rollout.sequences[:, 3:], sampled.rollout.completion_ids)  # split at the prompt width
    assert stats["dynamic/draws"] == 2


def test_resample_reports_the_first_draw_and_trains_on_the_batch_size(sample_groups):
    """Resampling reports the FIRST draw's statistics (a deadlock is not hidden by the fresh prompts that
    replaced its groups), and trains on as many groups as the step asked for, however many the extra draws
    kept: 2 asked, 1 kept from the first draw, 2 from the second, 2 trained."""
    first = make_draw(["a", "b"], [1, 1, 0, 1])  # one group of equal rewards: frac_reward_zero_std 0.5
    second = make_draw(["c", "d"], [0, 1, 2, 3])  # every group informative: 0.0
    sampled, stats = sample_groups({0: first, 1: second}, [{}, {}], lambda a: [{}, {}], "resample", 2, pad_id=0)
    assert stats["frac_reward_zero_std"] == 0.5
    assert [r["id"] for r in sampled.records] == ["b", "c"] and sampled.rewards.shape == (4,)


def test_no_informative_group_keeps_the_first_draw_with_zero_advantages(sample_groups):
    first = make_draw(["a", "b"], [1, 1, 0, 0])
    sampled, stats = sample_groups({0: first, 1: first}, [{}, {}], lambda a: [{}, {}], "resample",
                                   1, pad_id=0)
    assert sampled is first and bool((sampled.advantages == 0).all())
    assert stats["dynamic/kept_groups"] == 0


def test_importance_weights_follow_their_rows_through_resampling(sample_groups):
    """Another engine's IS weights [N, C] are selected and right-padded (with 0) like the completions."""
    first = make_draw(["a", "b"], [1, 1, 0, 1], width=3)
    second = make_draw(["c", "d"], [0, 1, 2, 2], width=5)
    first = Draw(*[getattr(first, f) for f in ("rollout", "records", "rewards", "advantages", "stats")],
                 torch.arange(12, dtype=torch.float32).view(4, 3))
    second = Draw(*[getattr(second, f) for f in ("rollout", "records", "rewards", "advantages", "stats")],
                  100 + torch.arange(20, dtype=torch.float32).view(4, 5))
    sampled, _ = sample_groups({0: first, 1: second}, [{}, {}], lambda a: [{}, {}], "resample", 2, pad_id=9)
    assert sampled.is_weights.shape == sampled.rollout.completion_ids.shape == (4, 5)
    assert sampled.is_weights[:2].tolist() == [[6, 7, 8, 0, 0], [9, 10, 11, 0, 0]]  # group b, padded
    assert sampled.is_weights[2:].tolist() == [[100, 101, 102, 103, 104], [105, 106, 107, 108, 109]]  # group c
