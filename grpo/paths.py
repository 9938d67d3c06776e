"""Every artifact path of the pipeline, derived from ``params.yaml: paths`` and ``experiment``.

One place, so a stage never imports another stage to learn where a file lives (that import would also
put the other stage's code into this stage's fingerprint). Folders:

| path | what |
| --- | --- |
| ``<data_dir>/{train,eval}.jsonl`` | the processed splits (``prepare``) |
| ``<models_dir>/{base,sft,grpo}`` | the three model folders, each with ``lineage.json`` |
| ``<runs_dir>/<experiment>/`` | checkpoints, ``metrics.jsonl``, ``entropy_history_<experiment>.json``, W&B |
| ``<metrics_dir>/<stage>.json`` | DVC metrics (``sft``, ``grpo``, ``eval``) |
| ``<reports_dir>/`` | validation, pre-flight and evaluation reports, ``entropy.png`` |
"""

from __future__ import annotations

from pathlib import Path

from grpo.config import Config

MODELS = ("base", "sft", "grpo")
STEP_METRICS_FILE = "metrics.jsonl"


def data_file(cfg: Config, split: str) -> Path:
    """``<data_dir>/<split>.jsonl`` (``train`` or ``eval``)."""
    return Path(cfg.paths.data_dir) / f"{split}.jsonl"


def model_dir(cfg: Config, name: str) -> Path:
    """``<models_dir>/base``, ``sft`` or ``grpo``."""
    if name not in MODELS:
        raise ValueError(f"unknown model folder {name!r}: expected one of {MODELS}")
    return Path(cfg.paths.models_dir) / name


def runs_root(cfg: Config) -> Path:
    """``<runs_dir>``: every experiment's run folder is under it."""
    return Path(cfg.paths.runs_dir)


def run_dir(cfg: Config) -> Path:
    """``<runs_dir>/<experiment>``: the GRPO run's checkpoints and per-step files."""
    return runs_root(cfg) / cfg.experiment


def step_metrics_file(run: Path) -> Path:
    """The per-step metrics JSONL of the run folder ``run``."""
    return Path(run) / STEP_METRICS_FILE


def entropy_history_file(run: Path, experiment: str) -> Path:
    """``<run>/entropy_history_<experiment>.json``: ``[{"step", "entropy"}]``."""
    return Path(run) / f"entropy_history_{experiment}.json"


def metrics_file(cfg: Config, name: str) -> Path:
    """``<metrics_dir>/<name>.json``: a stage's DVC metrics (``sft``, ``sft_history``, ``grpo``, ``eval``)."""
    return Path(cfg.paths.metrics_dir) / f"{name}.json"


def reports_dir(cfg: Config) -> Path:
    """``<reports_dir>``: validation, pre-flight and evaluation reports."""
    return Path(cfg.paths.reports_dir)


def report_file(cfg: Config, name: str) -> Path:
    """``<reports_dir>/<name>`` (``preflight.json``, ``eval.md``, ``entropy.png``, ...)."""
    return reports_dir(cfg) / name


def stage_inputs(cfg: Config, stage: str) -> dict[str, Path]:
    """What the artifact of ``stage`` is made from: its lineage records the content hash of each."""
    train = data_file(cfg, "train")
    inputs = {
        # The embedded tokenizer is trained on the training split; a resolved real model reads nothing.
        # A preset's inputs are its real tokenizer folder: ``model.base.base_inputs`` adds it.
        "base": {"train": train} if cfg.model.name_or_path is None and cfg.model.architecture is None else {},
        "sft": {"base": model_dir(cfg, "base"), "train": train},
        "preflight": {"base": model_dir(cfg, "base"), "sft": model_dir(cfg, "sft")},
        "grpo": {"sft": model_dir(cfg, "sft"), "train": train},
    }
    if stage not in inputs:
        raise ValueError(f"stage {stage!r} records no lineage inputs: expected one of {sorted(inputs)}")
    return inputs[stage]
