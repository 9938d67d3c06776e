"""The pipeline's three models, loaded from their folders and refused when stale.

``models/base``, ``models/sft`` and ``models/grpo`` carry ``lineage.json``; loading one built by other
code, params or inputs raises ``StaleArtifactError`` naming what changed. Every stage that reads a trained model (the
trainer, pre-flight, evaluation, diagnosis) loads it here, so none of them imports the stage that
wrote it (which would also put that stage's code into its fingerprint).
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo import paths
from grpo.config import Config
from grpo.model.base_model import base_inputs
from grpo.model.loading import check_weight_files, load_model, load_tokenizer
from grpo.provenance.lineage import check_lineage


def check_base(cfg: Config) -> None:
    """Raise ``StaleArtifactError`` unless ``models/base`` was built by the current code, params and inputs."""
    check_lineage(paths.model_dir(cfg, "base"), "base", cfg, base_inputs(cfg))


def load_base(cfg: Config) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``models/base``: the embedded tiny model or the pointer to ``model.name_or_path``, refusing one
    built by other code, params or inputs (StaleArtifactError)."""
    check_base(cfg)
    folder = paths.model_dir(cfg, "base")
    return load_model(folder, cfg.model), load_tokenizer(folder, cfg.model)


def check_sft(cfg: Config) -> None:
    """Raise ``StaleArtifactError`` unless ``models/sft``, and the base model under it, were built by the
    current code, params and inputs (SFT's lineage holds the base's content, not whether it is current)."""
    check_base(cfg)
    check_lineage(paths.model_dir(cfg, "sft"), "sft", cfg, paths.stage_inputs(cfg, "sft"))


def check_grpo(cfg: Config) -> None:
    """Raise ``StaleArtifactError`` unless ``models/grpo`` and the SFT model under it are current."""
    check_sft(cfg)
    check_lineage(paths.model_dir(cfg, "grpo"), "grpo", cfg, paths.stage_inputs(cfg, "grpo"))


def load_sft(cfg: Config) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The SFT model, refusing one trained by other code, params or inputs (StaleArtifactError)."""
    check_sft(cfg)
    folder = paths.model_dir(cfg, "sft")
    return load_model(folder, cfg.model), load_tokenizer(folder, cfg.model)


def load_grpo(cfg: Config) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GRPO policy exactly as the trainer saved it: its LoRA adapter on the SFT weights, or
    (``model.lora.enabled: false``) the fully fine-tuned weights. Both lineages are checked."""
    check_grpo(cfg)
    folder = paths.model_dir(cfg, "grpo")
    if not (folder / "adapter_config.json").is_file():
        return load_model(folder, cfg.model), load_tokenizer(folder, cfg.model)
    from peft import PeftModel

    check_weight_files(folder)
    model, _ = load_sft(cfg)
    return PeftModel.from_pretrained(model, folder), load_tokenizer(folder, cfg.model)
