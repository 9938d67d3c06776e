"""Which records a stage reads: grouped by task, interleaved, capped with both tasks kept."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

from grpo import paths
from grpo.config import Config
from grpo.data.errors import DataSourceError
from grpo.data.jsonl import read_records
from grpo.data.schema import TASKS


def split_by_task(records: Sequence[dict]) -> dict[str, list[dict]]:
    """Group records by their ``task`` field (every task of ``TASKS`` present), keeping file order."""
    by_task: dict[str, list[dict]] = {task: [] for task in TASKS}
    for record in records:
        by_task[record["task"]].append(record)
    return by_task


def interleave(groups: Sequence[Sequence[dict]], limit: int | None = None) -> list[dict]:
    """One record of each group in turn (a1, b1, a2, b2, ..., then the rest of the longer group),
    at most ``limit``: any prefix, and any strided shard, holds both tasks while both have records."""
    queues = [list(group) for group in groups]
    picked: list[dict] = []
    while any(queues) and (limit is None or len(picked) < limit):
        for queue in queues:
            if queue and (limit is None or len(picked) < limit):
                picked.append(queue.pop(0))
    return picked


def balanced_records(records: Sequence[dict], n: int) -> list[dict]:
    """At most ``n`` records, alternating tasks (file order within a task), so a cap keeps both tasks."""
    return interleave(list(split_by_task(records).values()), limit=n)


def held_out_for_grpo(record_id: str, seed: int, share: float) -> bool:
    """Whether a train record is one of GRPO's prompts: a seeded hash of its id below ``share``, so the
    same record lands on the same side whatever the file order or the other records."""
    digest = hashlib.sha256(f"grpo_holdout\x1f{seed}\x1f{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def _split_records(cfg: Config, split: str) -> list[dict]:
    """Every record of ``split``'s file; a missing or empty file is an error naming the fix."""
    path = paths.data_file(cfg, split)
    if not path.is_file():
        raise DataSourceError(f"{path}: no {split} split; run `grpo prepare` (or `dvc repro prepare`) first")
    records = read_records(path)
    if not records:
        raise DataSourceError(f"{path} holds no record; check data.n_{split} and rerun `grpo prepare`")
    return records


def train_records(cfg: Config, stage: Literal["sft", "grpo"]) -> list[dict]:
    """The train records ``stage`` reads, in file order.

    With ``data.grpo_holdout`` at 0 both stages read all of them. Above it, that share of the records
    (by ``held_out_for_grpo``) are GRPO's prompts and SFT never trains on them; SFT reads the rest.
    """
    records = _split_records(cfg, "train")
    share = cfg.data.grpo_holdout
    if share == 0:
        return records
    want_grpo = stage == "grpo"
    part = [r for r in records if held_out_for_grpo(r["id"], cfg.seed, share) == want_grpo]
    if not part:
        raise DataSourceError(
            f"{paths.data_file(cfg, 'train')}: data.grpo_holdout={share} leaves no train record for "
            f"{stage}; raise data.n_train or move data.grpo_holdout away from {'0' if want_grpo else '1'}"
        )
    return part


def eval_records(cfg: Config) -> list[dict]:
    """The eval split; with ``eval.max_examples``, that many records drawn alternately from each task."""
    records = _split_records(cfg, "eval")
    return balanced_records(records, cfg.eval.max_examples) if cfg.eval.max_examples else records
