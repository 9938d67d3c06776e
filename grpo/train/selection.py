"""Checkpoint selection on a validation split: ``models/grpo`` is the checkpoint a trade cannot win.

The last step of GRPO is not always its best, and a mean reward can rise while a kind of item gets
worse (saying "unknown" everywhere gains on ambiguous items and loses on disambiguated ones). With
``grpo.selection.rule: worst_kind`` the trainer sets ``grpo.selection.records`` of its training prompts
aside (``grpo/data/validation.py``: equal shares of each kind, never sampled as prompts, never eval
items), scores the SFT policy on them once (the reference: the adapter disabled, or the frozen SFT copy),
and scores the policy greedily every ``grpo.selection.every`` steps and at the last step. Each score is
the accuracy on each kind of item (the rewards' own parsers); it enters that step's metrics as
``selection/<kind>`` (metrics.jsonl, W&B, the checkpoint's history) and the step is checkpointed.

``choose`` takes the evaluated step whose WORST kind changed most favourably against SFT (ties: the
larger mean change over kinds, then the later step: where the split cannot tell checkpoints apart,
the last one stands, as without selection): a checkpoint that gains on one kind and loses on
another ranks by its loss. Its checkpoint is never pruned, and at the end its weights are what
``models/grpo`` holds; the choice and its reason go to ``metrics/grpo.json``, ``<run_dir>/selection.json``
and the run log.

Resume-safe: the scores live in the per-step history every checkpoint saves, so a resumed run restores
exactly the evaluations its checkpoint saw (later ones belonged to the abandoned timeline) and the SFT
scores are recomputed from the same weights. ``rule: last`` keeps every training prompt and takes the
last step, as before selection existed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

from accelerate.utils import gather_object

from grpo.config import Config
from grpo.data.kinds import ALL_KINDS, record_kind
from grpo.data.prompts import render_records
from grpo.data.schema import TASKS
from grpo.data.validation import validation_split
from grpo.errors import GrpoError
from grpo.files import write_json
from grpo.model.lora import adapter_disabled
from grpo.model.rollout import generate_rollout
from grpo.rewards import fairness_outcome, hallucination_outcome
from grpo.train import checkpoint as ckpt
from grpo.train import collectives
from grpo.train.sharding import gathered
from grpo.train.step_types import Step

PREFIX = "selection/"
"""Metric prefix of the validation scores (``selection/<kind>``: accuracy on that kind)."""
SECONDS = f"{PREFIX}seconds"
"""Metric: the seconds one scoring of the validation split took (its cost to the run)."""
SELECTION_FILE = "selection.json"
"""The run folder's record of the validation scores and the choice."""


class SelectionError(GrpoError):
    """Selection cannot run: no validation record, or none left to train on."""


class Choice(NamedTuple):
    """The checkpoint ``models/grpo`` is made from."""

    index: int
    """The step's number."""
    worst: float
    """Its worst kind's change of validation accuracy against SFT."""
    mean: float
    """Its mean change over the kinds."""
    reason: str
    """One line: why this step (its changes kind by kind, and the steps it beat)."""


def score_key(kind: str) -> str:
    return f"{PREFIX}{kind}"


def selecting(cfg: Config) -> bool:
    """Whether ``models/grpo`` is chosen on a validation split (``grpo.selection.rule`` is not ``last``)."""
    return cfg.grpo.selection.rule != "last"


def carve(cfg: Config, records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """``(training prompts, validation records)`` of GRPO's train records; no validation under ``last``."""
    if not selecting(cfg):
        return list(records), []
    train, validation = validation_split(records, cfg.grpo.selection.records, cfg.seed)
    tasks = {task for task in TASKS if any(r["task"] == task for r in records)}
    left = {task for task in tasks if any(r["task"] == task for r in train)}
    if not validation or left != tasks:
        raise SelectionError(
            f"grpo.selection.records={cfg.grpo.selection.records} leaves {len(train)} of {len(records)} GRPO "
            f"records to train on (tasks left: {sorted(left)}): lower grpo.selection.records, raise "
            "data.n_train, or set grpo.selection.rule: last"
        )
    return train, validation


def due(cfg: Config, index: int) -> bool:
    """Whether the validation split is scored after step ``index``."""
    return selecting(cfg) and (index % cfg.grpo.selection.every == 0 or index == cfg.grpo.steps)


# --------------------------------------------------------------------------- scoring


def _correct(text: str, record: dict) -> bool:
    if record["task"] == "fairness":
        return fairness_outcome(text, record).correct
    return hallucination_outcome(text, record).correct


def batch_size(cfg: Config) -> int:
    """Prompts per greedy call: the rollout's rows (``prompts_per_step * group_size``, which the trainer
    already holds at once), or ``eval.batch_size`` when larger. Few large calls cost less than many
    small ones: a decode loop's time goes mostly to its steps, not its rows."""
    return max(cfg.eval.batch_size, cfg.grpo.prompts_per_step * cfg.grpo.group_size)


def _replies(step: Step, model: Any, records: Sequence[dict]) -> list[str]:
    """Greedy replies of ``model`` to ``records`` through the one renderer and the rollout's stop ids."""
    cfg, size = step.cfg, batch_size(step.cfg)
    prompts = render_records(step.tokenizer, records, cfg.model.chat_template_kwargs)
    texts: list[str] = []
    for start in range(0, len(prompts), size):
        with step.autocast():
            rollout = generate_rollout(
                model,
                step.tokenizer,
                prompts[start : start + size],
                1,
                cfg.grpo.sampling,
                step.eos_ids,
                cfg.seed,
                greedy=True,
                fast=step.fast,
            )
        texts += rollout.texts
    return texts


def kind_accuracy(step: Step, records: Sequence[dict], reference: bool = False) -> dict[str, float]:
    """``{kind: accuracy}`` of the policy (``reference``: the SFT policy) answering ``records`` greedily.

    Each process answers every n-th record and the counts are summed over processes, so every process
    gets the same scores (and makes the same choice)."""
    accelerator = step.accelerator
    mine = list(records)[accelerator.process_index :: accelerator.num_processes]
    model = step.reference if reference and step.reference is not None else step.model
    disabled = adapter_disabled(step.model) if reference and step.reference is None else nullcontext()
    with gathered(model), disabled:
        texts = _replies(step, model, mine) if mine else []
    counts: dict[str, list[int]] = {}
    for text, record in zip(texts, mine, strict=True):
        count = counts.setdefault(record_kind(record), [0, 0])
        count[0] += _correct(text, record)
        count[1] += 1
    if collectives.several(accelerator):
        merged: dict[str, list[int]] = {}
        for part in gather_object([counts]):
            for kind, (right, n) in part.items():
                total = merged.setdefault(kind, [0, 0])
                total[0], total[1] = total[0] + right, total[1] + n
        counts = merged
    return {kind: counts[kind][0] / counts[kind][1] for kind in ALL_KINDS if kind in counts}


# --------------------------------------------------------------------------- choice


def evaluations(history: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """``(step, {kind: accuracy})`` of every evaluated step of a run's history, in order."""
    found = []
    for entry in history:
        scores = {kind: float(entry[score_key(kind)]) for kind in ALL_KINDS if score_key(kind) in entry}
        if scores:
            found.append((int(entry["step"]), scores))
    return found


def changes(scores: Mapping[str, float], sft: Mapping[str, float]) -> dict[str, float]:
    """Each kind's accuracy change against SFT's (the kinds both were scored on)."""
    return {kind: scores[kind] - sft[kind] for kind in ALL_KINDS if kind in scores and kind in sft}


def choose(evaluated: Sequence[tuple[int, Mapping[str, float]]], sft: Mapping[str, float]) -> Choice:
    """The step whose worst kind changed most favourably against ``sft`` (ties: larger mean change, then
    the later step: where the validation split cannot tell them apart, the most trained one, as without
    selection). ``evaluated``: ``(step, {kind: accuracy})``, as ``evaluations`` returns them.

    | step | ambiguous | disambiguated | worst | chosen                                   |
    | ---- | --------- | ------------- | ----- | ---------------------------------------- |
    | 10   | +0.40     | -0.20         | -0.20 | no: a trade ranks by its loss            |
    | 20   | +0.10     | +0.05         | +0.05 | yes                                      |
    | 30   | +0.05     | +0.05         | +0.05 | no: same worst, smaller mean             |
    """
    if not evaluated:
        raise SelectionError("no evaluated step to choose from: the run never evaluated its validation split")
    ranked = []
    for index, scores in evaluated:
        moved = changes(scores, sft)
        if not moved:
            raise SelectionError(
                f"step {index} was scored on no kind of item SFT was scored on: {sorted(scores)}"
            )
        ranked.append((min(moved.values()), sum(moved.values()) / len(moved), index, moved))
    worst, mean, index, moved = max(ranked)
    kinds = ", ".join(f"{kind} {change:+.3f}" for kind, change in moved.items())
    others = ", ".join(f"{s}: {w:+.3f}" for w, _, s, _ in ranked if s != index) or "none"
    reason = (
        f"step {index}: its worst kind changed {worst:+.3f} against SFT on the validation split ({kinds}); "
        f"the other evaluated steps' worst changes: {others}"
    )
    return Choice(index, worst, mean, reason)


def record(
    cfg: Config,
    run_dir: Path,
    sft: Mapping[str, float],
    history: Sequence[Mapping[str, Any]],
    n_records: int,
    choice: Choice | None = None,
) -> dict[str, Any]:
    """``<run_dir>/selection.json``: the rule, the SFT scores, every evaluation, the seconds they took and
    (at the end) the choice; returns what it wrote."""
    summary: dict[str, Any] = {
        "rule": cfg.grpo.selection.rule,
        "every": cfg.grpo.selection.every,
        "records": n_records,
        "sft": dict(sft),
        "evaluations": [{"step": index, "accuracy": scores} for index, scores in evaluations(history)],
        "seconds": sum(float(entry.get(SECONDS, 0.0)) for entry in history),
    }
    if choice is not None:
        summary |= {"step": choice.index, "worst_change": choice.worst, "mean_change": choice.mean}
        summary["reason"] = choice.reason
    write_json(run_dir / SELECTION_FILE, summary)
    return summary


# --------------------------------------------------------------------------- the trainer's side


class Selector:
    """Selection as the trainer runs it: made once per (re)start from GRPO's train records."""

    def __init__(self, cfg: Config, step: Step, records: Sequence[dict], run_dir: Path) -> None:
        self.cfg, self.step, self.run_dir = cfg, step, run_dir
        self.prompts, self.validation = carve(cfg, records)
        # Recomputed at every (re)start from the same SFT weights: the same scores a fresh run got.
        started = time.perf_counter()
        self.sft = kind_accuracy(step, self.validation, reference=True) if self.validation else {}
        self.sft_seconds = time.perf_counter() - started

    def due(self, index: int) -> bool:
        return bool(self.validation) and due(self.cfg, index)

    def scores(self, index: int) -> dict[str, float]:
        """``selection/<kind>`` of the policy after step ``index`` when it is due (and ``selection/seconds``,
        what scoring took), else nothing."""
        if not self.due(index):
            return {}
        started = time.perf_counter()
        scores = {score_key(kind): value for kind, value in kind_accuracy(self.step, self.validation).items()}
        return scores | {SECONDS: time.perf_counter() - started}

    def best(self, history: Sequence[Mapping[str, Any]]) -> Choice | None:
        """The best evaluated step of ``history`` so far (None before the first evaluation)."""
        evaluated = evaluations(history)
        return choose(evaluated, self.sft) if evaluated and self.validation else None

    def keep(self, history: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
        """Checkpoint steps pruning must spare: the best so far."""
        best = self.best(history)
        return () if best is None else (best.index,)

    def finish(self, history: Sequence[Mapping[str, Any]], last: int, is_main: bool) -> dict[str, Any] | None:
        """Load the chosen checkpoint's weights into the policy (unless it is the ``last`` step, whose weights
        the policy holds) and record the choice; None under ``rule: last``. Every process calls it."""
        choice = self.best(history)
        if choice is None:
            return None
        if choice.index != last:
            path = ckpt.checkpoint_path(self.run_dir, choice.index)
            if not ckpt.is_complete(path):
                raise SelectionError(
                    f"{path}: the checkpoint of the chosen step {choice.index} is missing or incomplete; it is "
                    "kept from pruning while it is the best, so the run folder was changed by hand: rerun "
                    "`grpo train` from scratch (delete the run folder) or use --select last"
                )
            ckpt.load_checkpoint(path, model=self.step.model, optimizer=None, scheduler=None)
        summary = {"rule": self.cfg.grpo.selection.rule, "step": choice.index, "reason": choice.reason}
        if is_main:
            print(f"grpo: models/grpo is {choice.reason}")
            summary = record(self.cfg, self.run_dir, self.sft, history, len(self.validation), choice)
            summary["sft_seconds"] = self.sft_seconds  # this (re)start's scoring of the SFT policy
        return summary
