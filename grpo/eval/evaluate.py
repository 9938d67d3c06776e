"""Stage ``evaluate``: base, SFT and GRPO models side by side on the eval split.

Each model present under ``paths.models_dir`` answers every eval prompt twice: greedily (what a user
sees) and ``eval.samples_per_prompt`` times at the training temperature (what GRPO explores). Both
go through the one renderer and the rollout's token-id path, so the evaluated prompts are exactly
the trained ones (I1, I3-I6). Parsing is the rewards' job and counting is ``eval_metrics``'s; this
module only wires them together:

- fairness: BBQ accuracy and bias scores (``bias_scores``) from ``fairness_outcome``;
- hallucination: ``hallucination_metrics`` from ``hallucination_outcome``, also per kind of question
  (``by_kind``: the record's template, e.g. ``company.year``, or a SQuAD title);
- sampled only: distinct-1/2 over all samples, self-BLEU within each prompt's samples (averaged),
  and mean token entropy of the sampling distribution on the sampled ids (I10).

Outputs: ``<metrics_dir>/eval.json`` (``{model: {greedy: {...}, sampled: {...}}}``, inner keys flat
for ``dvc metrics diff``), ``<metrics_dir>/eval_compare.json`` (baselines, GRPO − SFT intervals and the
verdict per task, ``grpo/eval/verdict.py``), ``<reports_dir>/eval.md`` (``grpo/eval/report.py``) and,
when the run left them, ``<reports_dir>/entropy.png``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo import paths
from grpo.config import Config
from grpo.core.advantages import per_row
from grpo.data.prompts import render_records
from grpo.data.select import eval_records
from grpo.errors import GrpoError
from grpo.eval.compare import (
    BASELINES,
    MODES,
    baseline_texts,
    fairness_item,
    hallucination_item,
    item_outcomes,
    paired_bootstrap,
)
from grpo.eval.metrics import (
    bias_scores,
    distinct_n,
    hallucination_metrics,
    mean,
    self_bleu,
)
from grpo.eval.plots import load_entropy_history, load_metrics_jsonl, plot_entropy, plot_eval_comparison
from grpo.eval.report import LABELS, markdown_report
from grpo.eval.verdict import verdicts
from grpo.files import write_atomically
from grpo.locks import writes
from grpo.model.device import make_accelerator, model_device
from grpo.model.fast import FastPaths
from grpo.model.precision import bf16_autocast
from grpo.model.rollout import Rollout, generate_rollout, stop_ids
from grpo.model.stage_models import check_grpo, check_sft, load_base, load_grpo, load_sft
from grpo.rewards import weighted_reward
from grpo.seeding import derive_seed

HOW_TO_BUILD = {"base": "grpo base", "sft": "grpo sft", "grpo": "grpo train"}


class EvaluationError(GrpoError):
    """The evaluation cannot run: no eval data, or no model to evaluate."""


# --------------------------------------------------------------------------- data and models


def load_eval_model(cfg: Config, name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load one of ``paths.MODELS``; SFT and GRPO are lineage-checked (StaleArtifactError when stale)."""
    return {"base": load_base, "sft": load_sft, "grpo": load_grpo}[name](cfg)


def available_models(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """``(present, skipped)``: the models whose folder exists, and why each other one is skipped."""
    present, skipped = [], {}
    for name in paths.MODELS:
        folder = paths.model_dir(cfg, name)
        if folder.is_dir():
            present.append(name)
        else:
            skipped[name] = f"{folder} is absent (run `{HOW_TO_BUILD[name]}` to build it)"
    return present, skipped


# --------------------------------------------------------------------------- generation


def entropy_sum(rollout: Rollout) -> tuple[float, int]:
    """``(sum of token entropies, number of tokens)`` over the completion masks of ``rollout``.

    The entropy the decode loop took from the logits that drew each token (``with_entropy``): the
    very generated ids (I3) at the temperature they were sampled at (I10), without a second pass.
    """
    if rollout.entropy is None:
        raise EvaluationError(
            "entropy_sum: the rollout carries no entropy; sample it with generate_rollout(..., with_entropy=True)"
        )
    return float(rollout.entropy.sum()), int(rollout.completion_mask.sum())


# --------------------------------------------------------------------------- metrics


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (what ``dvc metrics diff`` and the table show)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def task_metrics(texts: Sequence[str], records: Sequence[dict], cfg: Config) -> dict[str, Any]:
    """Fairness, hallucination and reward metrics of ``texts[i]`` answering ``records[i]`` (flat keys)."""
    fair = [(t, r) for t, r in zip(texts, records, strict=True) if r["task"] == "fairness"]
    hall = [(t, r) for t, r in zip(texts, records, strict=True) if r["task"] == "hallucination"]
    out: dict[str, Any] = {}
    if fair:
        out |= flatten(bias_scores([fairness_item(t, r) for t, r in fair]), "fairness/")
    if hall:
        out |= flatten(hallucination_metrics([hallucination_item(t, r) for t, r in hall]), "hallucination/")
    rewards = {
        task: [weighted_reward(task, t, r, cfg.rewards) for t, r in pairs]
        for task, pairs in (("fairness", fair), ("hallucination", hall))
    }
    out["reward"] = mean(rewards["fairness"] + rewards["hallucination"])
    out |= {f"rewards/{task}/mean": mean(values) for task, values in rewards.items() if values}
    return out


def diversity_metrics(texts: Sequence[str], group_size: int) -> dict[str, float]:
    """Distinct-1/2 over all ``texts``; self-BLEU within each group of ``group_size``, averaged."""
    groups = [texts[i : i + group_size] for i in range(0, len(texts), group_size)]
    return {
        "diversity/distinct_1": distinct_n(texts, 1),
        "diversity/distinct_2": distinct_n(texts, 2),
        "diversity/self_bleu": mean(self_bleu(group) for group in groups) or 0.0,
    }


class _Collected:
    """Texts, lengths and entropy sums of one decoding mode, gathered batch by batch."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.lengths: list[int] = []
        self.truncated: list[bool] = []
        self.entropy_sum, self.entropy_tokens = 0.0, 0

    def add(self, rollout: Rollout, entropy: tuple[float, int] = (0.0, 0)) -> None:
        """Append a batch; ``entropy`` is its ``entropy_sum`` (sum, tokens)."""
        self.texts += rollout.texts
        self.lengths += rollout.lengths.tolist()
        self.truncated += rollout.truncated.tolist()
        self.entropy_sum += entropy[0]
        self.entropy_tokens += entropy[1]

    def length_stats(self) -> dict[str, float | None]:
        return {
            "completions/mean_length": mean(self.lengths),
            "completions/clipped_ratio": mean(float(t) for t in self.truncated),
        }


def evaluate_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict],
    cfg: Config,
    desc: str = "eval",
    progress: bool = True,
    texts: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{"greedy": {...}, "sampled": {...}}`` of one model on ``records``; sampling is seeded per batch.
    Greedy only (no ``"sampled"`` key) when ``eval.samples_per_prompt`` is 0.

    ``texts``, when given, receives the replies: ``{"greedy": [N], "sampled": [N * samples_per_prompt]}``.
    """
    group = cfg.eval.samples_per_prompt
    greedy, sampled = _replies(model, tokenizer, records, cfg, desc, progress)
    if texts is not None:
        texts.update(greedy=greedy.texts, **({"sampled": sampled.texts} if group else {}))
    results = {"greedy": task_metrics(greedy.texts, records, cfg) | greedy.length_stats()}
    if group:
        results["sampled"] = (
            task_metrics(sampled.texts, per_row(records, group), cfg)
            | sampled.length_stats()
            | diversity_metrics(sampled.texts, group)
            | {"entropy": sampled.entropy_sum / max(sampled.entropy_tokens, 1)}
        )
    return results


def _replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict],
    cfg: Config,
    desc: str,
    progress: bool,
) -> tuple[_Collected, _Collected]:
    """``(greedy, sampled)``: each record's greedy reply and its ``eval.samples_per_prompt`` samples (with
    their entropy), ``eval.batch_size`` prompts at a time, through the trainer's stop ids and fast paths."""
    sampling, group, size = cfg.grpo.sampling, cfg.eval.samples_per_prompt, cfg.eval.batch_size
    eos_ids = stop_ids(model, tokenizer, cfg.model.extra_stop_tokens)  # the trainer's stop ids
    fast = FastPaths.resolve(cfg.model.fast_paths)
    prompts = render_records(tokenizer, records, cfg.model.chat_template_kwargs)
    greedy, sampled = _Collected(), _Collected()
    starts = range(0, len(prompts), size)
    for index, start in enumerate(tqdm(starts, desc=desc, disable=not progress)):
        batch = prompts[start : start + size]
        # The rollout's precision (grpo.bf16), each prompt's prefill shared by its samples (the same tokens).
        # The samples start from the greedy pass's keys and values where they are their prefill's very numbers.
        prompt_pass = fast.prompt_pass() if group else None
        with bf16_autocast(model_device(model), cfg.grpo.bf16):
            args = (model, tokenizer, batch)
            greedy.add(
                generate_rollout(*args, 1, sampling, eos_ids, cfg.seed, greedy=True, prompt_pass=prompt_pass, fast=fast)
            )
            if group:
                # Seeded by batch index, not by model: every model draws from the same random stream.
                rollout = generate_rollout(
                    *args,
                    group,
                    sampling,
                    eos_ids,
                    seed=derive_seed(cfg.seed, ("eval_batch", index)),
                    shared_prefill=True,
                    with_entropy=True,
                    prompt_pass=prompt_pass,
                    fast=fast,
                )
                sampled.add(rollout, entropy_sum(rollout))
    return greedy, sampled


def plot_run_entropy(cfg: Config) -> Path | None:
    """``<reports_dir>/entropy.png`` from the run's entropy history (+ its metrics JSONL); None if absent."""
    history = paths.entropy_history_file(paths.run_dir(cfg), cfg.experiment)
    if not history.is_file():
        return None
    metrics_file = paths.step_metrics_file(paths.run_dir(cfg))
    metrics = load_metrics_jsonl(metrics_file) if metrics_file.is_file() else None
    out = paths.report_file(cfg, "entropy.png")
    return plot_entropy({cfg.experiment: load_entropy_history(history)}, out, metrics=metrics)


def evaluate(
    cfg: Config, records: Sequence[dict], progress: bool = True, texts: dict[str, dict] | None = None
) -> tuple[dict[str, dict], dict[str, str]]:
    """Evaluate every present model, one at a time (only one is in memory); returns (results, skipped).

    ``texts``, when given, receives every model's replies: ``{model: {"greedy": [...], "sampled": [...]}}``.
    """
    present, skipped = available_models(cfg)
    if not present:
        raise EvaluationError(
            f"no model to evaluate under {paths.model_dir(cfg, 'base').parent}: run `grpo base` first"
        )
    # Refuse a stale SFT or GRPO model before spending time on the others.
    if "grpo" in present:
        check_grpo(cfg)
    elif "sft" in present:
        check_sft(cfg)
    results, device = {}, make_accelerator().device
    for name in present:
        model, tokenizer = load_eval_model(cfg, name)
        model = model.to(device).eval()
        replies: dict[str, list[str]] = {}
        results[name] = evaluate_model(model, tokenizer, records, cfg, f"eval {name}", progress, replies)
        if texts is not None:
            texts[name] = replies
        del model
    return results, skipped


def baseline_metrics(records: Sequence[dict], cfg: Config) -> dict[str, dict[str, Any]]:
    """``{baseline: flat metrics}`` of every baseline policy (``compare.BASELINES``) on ``records``."""
    return {name: task_metrics(baseline_texts(name, records, cfg.seed), records, cfg) for name in BASELINES}


def grpo_intervals(texts: dict[str, dict], records: Sequence[dict], cfg: Config) -> dict[str, dict] | None:
    """``{mode: {metric: {diff, low, high}}}`` of GRPO − SFT; None unless both models were evaluated.

    The bootstrap's unit is the eval item in both decodings: ``item_outcomes`` keeps a record's
    ``eval.samples_per_prompt`` sampled replies together, so a resample draws items, each with all its
    samples (drawing samples one by one would treat a record's correlated replies as independent items and
    narrow every interval)."""
    if not {"sft", "grpo"} <= set(texts):
        return None
    return {
        mode: paired_bootstrap(
            item_outcomes(texts["grpo"][mode], records, cfg.rewards),
            item_outcomes(texts["sft"][mode], records, cfg.rewards),
            cfg.eval.bootstrap,
            cfg.seed,
        )
        for mode in MODES
        if mode in texts["grpo"]
    }


@writes(lambda cfg: cfg.paths.metrics_dir)
def run(cfg: Config) -> int:
    """``grpo evaluate``: write eval.json, eval_compare.json, eval.md and (when a run exists) entropy.png."""
    records = eval_records(cfg)
    texts: dict[str, dict] = {}
    results, skipped = evaluate(cfg, records, texts=texts)
    intervals = grpo_intervals(texts, records, cfg)
    compare = {
        "baselines": baseline_metrics(records, cfg),
        "grpo_minus_sft": intervals,
        "verdicts": verdicts(intervals),
    }
    metrics, report = paths.metrics_file(cfg, "eval"), paths.report_file(cfg, "eval.md")
    write_atomically(
        {
            metrics: json.dumps(results, indent=2) + "\n",
            paths.metrics_file(cfg, "eval_compare"): json.dumps(compare, indent=2) + "\n",
            report: markdown_report(results, skipped, len(records), cfg, compare),
        }
    )
    for name, reason in skipped.items():
        print(f"evaluate: {LABELS[name]} skipped: {reason}")
    plot = plot_run_entropy(cfg)
    plot_eval_comparison(results, paths.report_file(cfg, "eval.png"))
    for mode, tasks in compare["verdicts"].items():
        for verdict in tasks.values():
            print(f"evaluate: {mode}: {verdict['summary']}")
    print(
        f"evaluate: {', '.join(LABELS[n] for n in results)} -> {metrics}, {report}"
        + (f", {plot}" if plot else "")
    )
    return 0
