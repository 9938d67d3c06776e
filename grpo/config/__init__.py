"""One typed configuration tree, loaded from ``params.yaml``: a module per layer it configures.

Every field carries a one-line docstring (pydantic reads them as descriptions). Unknown keys are an
error that names the key and the file; a bad value is an error that names the key, the value and the
fix. Values derived from others are functions, never fields to keep in sync.

| module | sections |
| --- | --- |
| ``tree.py`` | the root ``Config``, ``paths``, loading (``extends``, ``--set``) |
| ``data.py`` | ``data`` |
| ``model.py`` | ``model`` (``tiny``, ``lora``) |
| ``train.py`` | ``pretrain``, ``sft``, ``grpo`` (``sampling``, ``rollout``, ``loss``, ``multitask``), ``checkpoint`` |
| ``rewards.py`` | ``rewards`` |
| ``health.py`` | ``monitor``, ``tracking`` |
| ``eval.py`` | ``eval`` (``diagnose``) |
| ``orchestration.py`` | ``schedule`` |
"""

from grpo.config.base import ConfigError, Section
from grpo.config.data import DataChecksConfig, DataConfig
from grpo.config.eval import DiagnoseConfig, EvalConfig, PreflightConfig
from grpo.config.health import MonitorConfig, RuleConfig, TrackingConfig
from grpo.config.model import Architecture, FastPathsSetting, LoraConfig, ModelConfig, TinyModelConfig
from grpo.config.orchestration import ScheduleConfig
from grpo.config.rewards import AbstainRewards, RewardsConfig, RewardWeights
from grpo.config.train import (
    CheckpointConfig,
    GrpoConfig,
    LossConfig,
    MultitaskConfig,
    OptimizerConfig,
    PretrainConfig,
    RolloutConfig,
    SamplingConfig,
    SelectionConfig,
    SftConfig,
)
from grpo.config.tree import (
    DEFAULT_PARAMS,
    Config,
    PathsConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    overlay,
    parse_override,
    read_params,
)

__all__ = [
    "DEFAULT_PARAMS",
    "AbstainRewards",
    "Architecture",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataChecksConfig",
    "DataConfig",
    "DiagnoseConfig",
    "EvalConfig",
    "FastPathsSetting",
    "GrpoConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "MonitorConfig",
    "MultitaskConfig",
    "OptimizerConfig",
    "PathsConfig",
    "PreflightConfig",
    "PretrainConfig",
    "RewardWeights",
    "RewardsConfig",
    "RolloutConfig",
    "RuleConfig",
    "SamplingConfig",
    "ScheduleConfig",
    "SelectionConfig",
    "Section",
    "SftConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "overlay",
    "parse_override",
    "read_params",
]
