"""The root of the tree, ``paths``, and loading ``params.yaml`` (with a profile's ``extends`` and ``--set``).

Every default here equals ``params.yaml`` (``tests/test_config.py`` holds the two together), so a
partial params file, a test building ``Config()`` and a library user all get the pipeline the README
documents. A params file may start with ``extends: <another params file>`` (a path relative to it):
its own keys then overlay that file's, section by section, as ``configs/*.yaml`` profiles overlay
``params.yaml``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from grpo.config.base import ConfigError, Section
from grpo.config.data import DataConfig
from grpo.config.eval import EvalConfig, PreflightConfig
from grpo.config.health import MonitorConfig, TrackingConfig
from grpo.config.model import ModelConfig
from grpo.config.orchestration import ScheduleConfig
from grpo.config.rewards import RewardsConfig
from grpo.config.train import CheckpointConfig, GrpoConfig, PretrainConfig, SftConfig

DEFAULT_PARAMS = Path("params.yaml")
EXTENDS = "extends"


class PathsConfig(Section):
    data_dir: str = "data/processed"
    """Processed dataset folder: ``train.jsonl`` and ``eval.jsonl`` in the unified schema."""
    models_dir: str = "models"
    """Model folders: ``base/``, ``sft/``, ``grpo/``."""
    metrics_dir: str = "metrics"
    """DVC metrics JSON files."""
    reports_dir: str = "reports"
    """Human-readable reports (validation, preflight, evaluation)."""
    runs_dir: str = "runs"
    """Per-run state: checkpoints, per-step JSONL, W&B files, entropy history."""


class Config(Section):
    seed: int = 1234
    """Seed of every random generator of a run."""
    experiment: str = "default"
    """Run name: used for W&B and ``entropy_history_<experiment>.json``."""
    paths: PathsConfig = Field(default_factory=PathsConfig)
    """Where stages read and write."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Dataset generation and loading."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Base model and tokenizer."""
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    """Causal-LM pretraining of the embedded model in the ``base`` stage."""
    sft: SftConfig = Field(default_factory=SftConfig)
    """Supervised fine-tuning."""
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    """Bounds of the pre-flight gate's behaviour checks."""
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    """GRPO training."""
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    """Reward weights per task."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking (W&B)."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Health rules over the per-step metrics: threshold, window and action of each."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Atomic checkpoints of a GRPO run."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation of base, SFT and GRPO models, and ``grpo diagnose`` thresholds."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Nightly Prefect deployment of the full-retrain flow (read by ``flows/serve.py`` only)."""


# --------------------------------------------------------------------------- loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"grpo.loss.beta=0.1"`` -> ``("grpo.loss.beta", 0.1)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set grpo.loss.beta=0.1")
    return key.strip(), yaml.safe_load(raw)


def _describe(error: dict[str, Any], source: str) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{source}: unknown key {key} (got {error['input']!r}): remove it or fix its spelling"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    return f"{source}: {key} {message} (got {value!r}); fix it in {source} or with --set {key}=..."


def config_from_dict(tree: dict[str, Any], source: str = "params.yaml") -> Config:
    """Validate a raw tree; every problem is reported with its key, value and fix."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        lines = [_describe(err, source) for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top``'s keys over ``base``'s: sections merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            overlay(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def read_params(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The raw tree of a params file, its ``extends`` chain resolved (each path relative to its file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such params file; run from the project root or pass --params PATH")
    if path.resolve() in _seen:
        raise ConfigError(
            f"{path}: `extends` comes back to a file it started from ({_seen[0]}); break the cycle"
        )
    text = path.read_text(encoding="utf-8")
    try:
        tree = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if tree is None:  # an empty file (or only whitespace and comments) is a cut copy more often than a choice
        raise ConfigError(
            f"{path}: the params file is empty (no value, only whitespace or comments): a cut copy or a "
            "failed write would otherwise train on every default; restore the file, or write `{}` in it "
            "to mean all defaults"
        )
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    if not tree:
        print(f"{path}: {{}}: every value is the default (grpo/config)", file=sys.stderr)
    parent = tree.pop(EXTENDS, None)
    if parent is None:
        return tree
    if not isinstance(parent, str):
        raise ConfigError(
            f"{path}: {EXTENDS} must be the path of a params file (got {parent!r}), e.g. "
            f"`{EXTENDS}: ../params.yaml`"
        )
    return overlay(read_params(path.parent / parent, (*_seen, path.resolve())), tree)


def load_config(path: str | Path = DEFAULT_PARAMS, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``params.yaml`` (or a profile that extends it) and apply ``--set section.key=value`` overrides."""
    tree = read_params(path)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    source = f"{path}" + (" (with --set overrides)" if overrides else "")
    return config_from_dict(tree, source)


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain dict of the whole tree (for hashing, W&B and reports)."""
    return config.model_dump(mode="json")
