"""Stage ``prepare``: generate or load both tasks into ``<data_dir>/{train,eval}.jsonl``.

The same params and seed give byte-identical files. Sizes: ``data.n_train``/``data.n_eval`` records,
``data.fairness_fraction`` of them fairness. Published sources are split by group (template, article,
question) and sampled per split, stratified on the balance validation checks. Both files are written
atomically: a failure leaves earlier outputs as they were.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from grpo import paths
from grpo.config import Config, DataChecksConfig
from grpo.data.bbq import hold_out_categories
from grpo.data.errors import DataSourceError
from grpo.data.jsonl import SOURCES_FILE, records_text
from grpo.data.loaders import LOADERS
from grpo.data.raw import skip_lines
from grpo.data.schema import SPLITS, Record, make_record
from grpo.data.splits import apply_sft_noise, stratified_sample
from grpo.data.synthetic_fairness import generate_fairness
from grpo.data.synthetic_grounded import generate_grounded
from grpo.data.text import text_key
from grpo.files import write_atomically
from grpo.locks import writes

Pools = dict[str, list[dict[str, Any]]]


def split_sizes(cfg: Config) -> dict[str, dict[str, int]]:
    """Records per task and split: ``{"fairness": {"train": .., "eval": ..}, "hallucination": {...}}``."""
    sizes: dict[str, dict[str, int]] = {"fairness": {}, "hallucination": {}}
    for split, n in (("train", cfg.data.n_train), ("eval", cfg.data.n_eval)):
        n_fair = round(n * cfg.data.fairness_fraction)
        sizes["fairness"][split], sizes["hallucination"][split] = n_fair, n - n_fair
    return sizes


def _strata(task: str, answerable_fraction: float) -> tuple[Any, dict[Any, float]]:
    if task == "fairness":
        shares = {(c, p): 0.25 for c in ("ambig", "disambig") for p in ("neg", "nonneg")}
        return (lambda item: (item["context_condition"], item["question_polarity"])), shares
    return (lambda item: item["answerable"]), {True: answerable_fraction, False: 1 - answerable_fraction}


def _too_long(item: dict[str, Any], checks: DataChecksConfig) -> str | None:
    """Why the item breaks a ``length.<field>`` rule of the suite, or None.

    ``sft_answer`` is filled later with the answer or the distractor, so bounding those bounds it too.
    """
    texts = [
        ("context", "max_context_chars", item["context"]),
        ("question", "max_question_chars", item["question"]),
        ("answer", "max_answer_chars", item["answer"]),
        ("distractor", "max_answer_chars", item.get("distractor") or ""),
    ]
    texts += [("a choice", "max_answer_chars", choice) for choice in item.get("choices") or ()]
    for field, key, text in texts:
        limit = getattr(checks, key)
        if len(text) > limit:
            return f"{field} longer than data.checks.{key} ({limit})"
    return None


def _usable(pools: Pools, checks: DataChecksConfig, skipped: Counter, path: Path) -> Pools:
    """Drop items over the length bounds and repeated texts (a repeat in eval of a train text too)."""
    seen: set[str] = set()
    kept: Pools = {}
    for split in SPLITS:
        kept[split] = []
        for item in pools[split]:
            key, reason = text_key(item["context"], item["question"]), _too_long(item, checks)
            if reason is None and key in seen:
                reason = "repeated (context, question)"
            if reason is not None:
                skipped[(str(path), str(item["category"]), reason)] += 1
                continue
            seen.add(key)
            kept[split].append(item)
    return kept


def _too_few(path: Path, source: str, task: str, split: str, have: int, want: int, skipped: Counter) -> str:
    why = ("; raw items skipped: " + "; ".join(skip_lines(skipped))) if skipped else ""
    # data.fairness_fraction is the fairness share: lowering it asks for more hallucination records.
    share = "lower" if task == "fairness" else "raise"
    return (
        f"{path}: {source} gives {have} usable {split} {task} records but params ask for {want} "
        f"(data.n_{split} x the task's share){why}; lower data.n_{split} or {share} data.fairness_fraction"
        + (", or fix the skipped rows" if skipped else ", or give a file with more items")
    )


def _loaded(task: str, cfg: Config, sizes: dict[str, int]) -> tuple[Pools, Counter]:
    source, path = getattr(cfg.data, f"{task}_source"), Path(getattr(cfg.data, f"{task}_path"))
    eval_share = cfg.data.n_eval / (cfg.data.n_train + cfg.data.n_eval)
    loaded = LOADERS[source](path, eval_share, cfg.seed)
    if task == "fairness" and cfg.data.fairness_heldout_categories:
        loaded = hold_out_categories(loaded, cfg.data.fairness_heldout_categories, path)
    skipped = Counter(loaded.skipped)
    pools = _usable(loaded.pools, cfg.data.checks, skipped, path)
    stratum, shares = _strata(task, cfg.data.answerable_fraction)
    rng = random.Random(f"sample:{task}:{cfg.seed}")
    for split in SPLITS:
        if len(pools[split]) < sizes[split]:
            raise DataSourceError(
                _too_few(path, source, task, split, len(pools[split]), sizes[split], skipped)
            )
        pools[split] = stratified_sample(pools[split], sizes[split], stratum, shares, rng)
    return pools, skipped


def sources_summary(cfg: Config, skipped: dict[str, Counter]) -> str:
    """``sources.json``: per task its source, path and skipped raw items (file, category, reason, count)."""
    summary = {}
    for task in ("fairness", "hallucination"):
        rows = [
            {"file": file, "category": category, "reason": reason, "count": n}
            for (file, category, reason), n in sorted(skipped[task].items())
        ]
        summary[task] = {
            "source": getattr(cfg.data, f"{task}_source"),
            "path": getattr(cfg.data, f"{task}_path"),
            "skipped": rows,
        }
    return json.dumps(summary, indent=2, sort_keys=True) + "\n"


def _task_pools(task: str, cfg: Config, sizes: dict[str, int]) -> tuple[Pools, Counter]:
    if getattr(cfg.data, f"{task}_source") != "synthetic":
        return _loaded(task, cfg, sizes)
    if task == "fairness":
        return {split: generate_fairness(sizes[split], split, cfg.seed) for split in SPLITS}, Counter()
    pools = {
        split: generate_grounded(sizes[split], split, cfg.seed, cfg.data.answerable_fraction)
        for split in SPLITS
    }
    return pools, Counter()


def build_records(cfg: Config, skipped_by_task: dict[str, Counter] | None = None) -> dict[str, list[Record]]:
    """Every record of both splits, SFT targets filled (and noised) on train; nothing is written.

    ``skipped_by_task``, when given, receives each task's skipped raw items.
    """
    sizes = split_sizes(cfg)
    by_split: dict[str, list[Record]] = {split: [] for split in SPLITS}
    for task in ("fairness", "hallucination"):
        pools, skipped = _task_pools(task, cfg, sizes[task])
        if skipped_by_task is not None:
            skipped_by_task[task] = skipped
        asked = {"answer_format": cfg.data.fairness_answer} if task == "fairness" else {}
        for split in SPLITS:
            by_split[split].extend(make_record(fields | asked, split) for fields in pools[split])
        source = getattr(cfg.data, f"{task}_source")
        note = f"; skipped {sum(skipped.values())} raw items (see sources.json)" if skipped else ""
        print(
            f"prepare: {task} from {source}: {sizes[task]['train']} train, {sizes[task]['eval']} eval{note}"
        )
    rng = random.Random(f"order:{cfg.seed}")
    for split in SPLITS:
        rng.shuffle(by_split[split])
    by_split["train"] = apply_sft_noise(by_split["train"], cfg.data.sft_noise, cfg.seed)
    return by_split


@writes(lambda cfg: cfg.paths.data_dir)
def run(cfg: Config) -> int:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``paths.data_dir`` (atomically)."""
    skipped: dict[str, Counter] = {}
    by_split = build_records(cfg, skipped)
    files = {split: paths.data_file(cfg, split) for split in SPLITS}
    write_atomically(
        {
            **{files[split]: records_text(by_split[split]) for split in SPLITS},
            Path(cfg.paths.data_dir) / SOURCES_FILE: sources_summary(cfg, skipped),
        }
    )
    print(f"prepare: wrote {', '.join(str(file) for file in files.values())}")
    return 0
