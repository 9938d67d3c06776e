"""Metrics: names, helpers, and the writer's JSONL, entropy history, resume and W&B files."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from grpo.config import TrackingConfig
from grpo.health.metrics import (
    HEALTH_METRICS,
    MetricsError,
    MetricsWriter,
    completion_stats,
    effective_wandb_mode,
    read_metrics,
    task_reward_stats,
)
from grpo.paths import entropy_history_file
from tests.network_trace import attempts, traced

ROOT = Path(__file__).resolve().parents[1]

DISABLED = TrackingConfig(wandb="disabled")


def step_metrics(step: int) -> dict:
    return {"reward": 0.1 * step, "entropy": 2.0 - 0.01 * step, "cagrad/weights": torch.tensor([0.4, 0.6])}


def test_health_metrics_name_every_design_metric():
    for name in (
        "reward", "reward_std", "rewards/fairness/mean", "rewards/fairness/std", "rewards/hallucination/mean",
        "rewards/hallucination/std", "frac_reward_zero_std", "entropy", "policy/entropy", "kl",
        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
        "completions/min_length", "completions/max_length", "completions/clipped_ratio", "eos_suppressed_frac",
        "logits/max", "logits/top1_gap", "logits/top5_mass", "grad_norm/fairness", "grad_norm/hallucination",
        "grad_cos", "cagrad/weights", "step_time", "tokens_per_s",
    ):
        assert name in HEALTH_METRICS, name
    assert len(HEALTH_METRICS) == len(set(HEALTH_METRICS)) == 27


def test_completion_stats():
    stats = completion_stats(torch.tensor([3, 5, 10, 10]), torch.tensor([False, False, True, True]))
    assert stats == {
        "completions/mean_length": 7.0, "completions/min_length": 3.0,
        "completions/max_length": 10.0, "completions/clipped_ratio": 0.5,
    }
    with pytest.raises(MetricsError, match=r"\[N\]"):
        completion_stats(torch.tensor([[3]]), torch.tensor([[True]]))
    with pytest.raises(MetricsError, match=r"N > 0"):
        completion_stats(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.bool))
    one = completion_stats(torch.tensor([4]), torch.tensor([True]))  # one completion is a batch
    assert one["completions/min_length"] == one["completions/max_length"] == 4.0


def test_a_fresh_writer_makes_its_folder_and_an_empty_entropy_history_and_close_closes(tmp_path):
    run = tmp_path / "runs" / "new"
    writer = MetricsWriter(run, "exp", DISABLED, {})
    assert json.loads(entropy_history_file(run, "exp").read_text()) == []
    handle = writer._file
    writer.close()
    assert handle.closed and writer._file is None
    writer.close()  # idempotent


def test_a_resume_keeps_the_first_of_a_repeated_step_and_cuts_the_rest(tmp_path):
    """Steps on disk must increase: a second line for step 1 ends what a resume keeps (the checkpoint's own
    history then supplies step 2)."""
    from grpo.paths import step_metrics_file

    lines = [json.dumps({"step": 1, "loss": 1.0}), json.dumps({"step": 1, "loss": 9.0}),
             json.dumps({"step": 2, "loss": 2.0})]
    step_metrics_file(tmp_path).write_text("".join(line + "\n" for line in lines))
    restored = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5}]
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=2, restored=restored) as writer:
        assert [(r["step"], r["loss"]) for r in writer.history] == [(1, 1.0), (2, 2.5)]
    assert [json.loads(line)["loss"] for line in step_metrics_file(tmp_path).read_text().splitlines()] == [1.0, 2.5]


def test_task_reward_stats_per_task():
    rewards = torch.tensor([1.0, -1.0, 0.5, 1.0, 1.0])
    stats = task_reward_stats(rewards, ["fairness", "fairness", "hallucination", "hallucination", "hallucination"])
    assert stats["rewards/fairness/mean"] == 0.0 and stats["rewards/fairness/std"] == 1.0
    assert stats["rewards/hallucination/mean"] == pytest.approx(2.5 / 3)
    assert stats["rewards/hallucination/std"] == pytest.approx(torch.tensor([0.5, 1.0, 1.0]).std(correction=0).item())
    assert task_reward_stats(torch.tensor([1.0]), ["fairness"]) == {"rewards/fairness/mean": 1.0, "rewards/fairness/std": 0.0}
    with pytest.raises(MetricsError, match="math"):
        task_reward_stats(torch.tensor([1.0]), ["math"])


@pytest.mark.parametrize(
    ("configured", "env", "expected"),
    [("offline", None, "offline"), ("online", "offline", "offline"), ("disabled", "offline", "disabled"),
     ("offline", "online", "offline"), ("online", "disabled", "disabled"), ("online", "dryrun", "offline")],
)
def test_wandb_mode_is_the_stricter_of_params_and_env(configured, env, expected):
    assert effective_wandb_mode(configured, env) == expected


def test_a_mistyped_wandb_mode_is_refused():
    with pytest.raises(MetricsError, match="WANDB_MODE='ofline' is not one of"):
        effective_wandb_mode("online", "ofline")


def test_writer_appends_one_json_line_per_step(tmp_path):
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in (1, 2, 3):
            writer.log(step, step_metrics(step))
            assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step  # flushed per line
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["cagrad/weights"] == pytest.approx([0.4, 0.6])
    assert records[2]["policy/entropy"] == records[2]["entropy"] == pytest.approx(1.97)
    assert not (tmp_path / "wandb").exists()  # disabled mode writes no W&B files


def test_entropy_history_has_one_entry_per_step(tmp_path):
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in range(1, 5):
            writer.log(step, step_metrics(step))
        writer.log(5, {"entropy": math.nan})
    history = json.loads(entropy_history_file(tmp_path, "exp").read_text())
    assert history[:2] == [{"step": 1, "entropy": pytest.approx(1.99)}, {"step": 2, "entropy": pytest.approx(1.98)}]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5] and history[-1]["entropy"] is None


def test_writer_rejects_a_step_logged_twice(tmp_path):
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        writer.log(1, step_metrics(1))
        with pytest.raises(MetricsError, match="step 1 logged after step 1"):
            writer.log(1, step_metrics(1))
        with pytest.raises(MetricsError, match="'bad'"):
            writer.log(2, {"bad": object()})


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in range(1, 8):
            writer.log(step, step_metrics(step))
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "rew')  # the line a kill cut short
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=5) as writer:
        assert writer.last_step == 5
        for step in range(6, 9):
            writer.log(step, step_metrics(step))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 9))
    history = json.loads(entropy_history_file(tmp_path, "exp").read_text())
    assert [h["step"] for h in history] == list(range(1, 9))


def _checkpoint_history(upto: int) -> list[dict]:
    """What a checkpoint's history.json holds: each step's raw metrics, as JSON gives them back."""
    return json.loads(json.dumps([{"step": s, **step_metrics(s)} for s in range(1, upto + 1)], default=torch.Tensor.tolist))


@pytest.mark.parametrize("lines_left", [0, 2, 5])
def test_a_resume_never_drops_a_step_its_checkpoint_holds(tmp_path, lines_left):
    """The file lost lines the checkpoint of step 5 holds (another writer rewrote it, a copy was cut):
    the resume puts them back from the checkpoint, byte for byte, and the run goes on with every step once."""
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in range(1, 8):
            writer.log(step, step_metrics(step))
    path = tmp_path / "metrics.jsonl"
    whole = path.read_text().splitlines(keepends=True)
    path.write_text("".join(whole[:lines_left]))
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=5, restored=_checkpoint_history(5)) as writer:
        assert writer.last_step == 5
        for step in range(6, 9):
            writer.log(step, step_metrics(step))
    lines = path.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))
    assert lines[:7] == whole[:7]  # restored lines are the lines the run wrote; re-run steps 6, 7 alike
    history = json.loads(entropy_history_file(tmp_path, "exp").read_text())
    assert [h["step"] for h in history] == list(range(1, 9))


def test_a_resume_cuts_the_file_in_place_and_never_rewrites_the_steps_it_keeps(tmp_path):
    """Append-only: resuming truncates the one file after the checkpoint's step (a reader that follows
    it, or a writer that still holds it open, keeps the same file) and leaves the kept bytes alone."""
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in range(1, 8):
            writer.log(step, step_metrics(step))
    path = tmp_path / "metrics.jsonl"
    before, inode = path.read_bytes(), path.stat().st_ino
    follower = open(path, "rb")  # noqa: SIM115 - a reader following the file across the resume
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=5, restored=_checkpoint_history(5)) as writer:
        writer.log(6, step_metrics(6))
    kept = len(b"".join(before.splitlines(keepends=True)[:5]))
    assert path.stat().st_ino == inode
    assert path.read_bytes()[:kept] == before[:kept]
    assert [json.loads(line)["step"] for line in follower.read().splitlines()] == list(range(1, 7))
    follower.close()


def test_a_line_that_breaks_the_order_ends_what_a_resume_keeps(tmp_path):
    """Lines after a cut, unreadable or out-of-order line are not trusted: the checkpoint restores them."""
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in (1, 2)]
    path.write_text(good[0] + good[1] + '{"step": 1, "reward": 9}\n{"step": 3}\n')
    restored = [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)]
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=3, restored=restored) as writer:
        assert [r["step"] for r in writer.history] == [1, 2, 3]
    assert path.read_text().splitlines() == [*(line.strip() for line in good), json.dumps(restored[2])]


def test_fresh_run_starts_new_files(tmp_path):
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        writer.log(1, step_metrics(1))
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        writer.log(1, step_metrics(1))
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_non_main_process_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, "exp", TrackingConfig(wandb="offline"), {}, is_main_process=False) as writer:
        writer.log(1, step_metrics(1))
    assert not run_dir.exists()


def test_offline_wandb_run_lives_in_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    with MetricsWriter(tmp_path, "exp", TrackingConfig(wandb="offline"), {"seed": 1}) as writer:
        for step in (1, 2):
            writer.log(step, step_metrics(step))
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    assert b"policy/entropy" in run_files[0].read_bytes()
    assert b"cagrad/weights/1" in run_files[0].read_bytes()



OFFLINE_RUN = """
import sys
from grpo.config import TrackingConfig
from grpo.health.metrics import MetricsWriter
with MetricsWriter(sys.argv[1], "exp", TrackingConfig(wandb="offline"), {"seed": 1}) as writer:
    for step in (1, 2, 3):
        writer.log(step, {"reward": 0.5, "entropy": 1.0 - 0.1 * step})
"""


def test_an_offline_wandb_run_makes_no_network_attempt(tmp_path):
    """``tracking.wandb: offline`` as a user runs it (no WANDB_* in the environment): the run is written
    and no process (this one, W&B's Go service) looks up or connects to any host (tests/network_trace.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = str(ROOT)
    done, reached = traced([sys.executable, "-c", OFFLINE_RUN, str(tmp_path / "run")], tmp_path / "trace.log",
                           env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")), "no offline run written"
    assert reached == [], "network attempts of an offline run:\n" + "\n".join(reached)


@pytest.mark.parametrize(
    ("line", "reaches"),
    [
        # table: an strace line -> whether it is a network attempt
        ('connect(3, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("34.1.2.3")}, 16) = 0', True),
        ('connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.53")}, 16) = 0', True),
        ('sendto(3, "x", 1, 0, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.2")}, 16)', True),
        ('connect(3, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), '
         'inet_pton(AF_INET6, "2606:4700::1", &sin6_addr), sin6_scope_id=0}, 28) = -1 ENETUNREACH', True),
        ('connect(3, {sa_family=AF_UNIX, sun_path="/run/systemd/resolve/io.systemd.Resolve"}, 42) = 0', True),
        ('connect(3, {sa_family=AF_INET, sin_port=htons(8080), sin_addr=inet_addr("127.0.0.1")}, 16) = 0', False),
        ('connect(3, {sa_family=AF_INET6, sin6_port=htons(80), sin6_flowinfo=htonl(0), '
         'inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0', False),
        ('connect(7, {sa_family=AF_UNIX, sun_path="/tmp/wandb-1-2-3/socket"}, 41) = 0', False),
    ],
)
def test_the_network_trace_counts_lookups_and_remote_connects(line, reaches):
    assert attempts(f"4242  {line}") == ([f"4242  {line}"] if reaches else [])


def test_a_whole_record_cut_before_its_newline_is_restored_not_continued(tmp_path):
    """A kill between a record's last byte and its newline: the resume must not append the next step to that line."""
    with MetricsWriter(tmp_path, "exp", DISABLED, {}) as writer:
        for step in range(1, 7):
            writer.log(step, step_metrics(step))
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(path.read_bytes().removesuffix(b"\n"))
    with MetricsWriter(tmp_path, "exp", DISABLED, {}, resume_step=6, restored=_checkpoint_history(6)) as writer:
        writer.log(7, step_metrics(7))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 8))


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    """Only the last line may be cut by a kill: a bad line in the middle means the file was edited or
    corrupted, and reading on would hand the monitor's resume a history with a step missing."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n', encoding="utf-8")
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": 2, "rew\n\n', encoding="utf-8")  # cut last line, blank after it
    assert read_metrics(path) == [{"step": 1}]
