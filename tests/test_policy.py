"""grpo/train/policy.py: the trainer's policy trains in train mode, so gradient checkpointing acts."""

from __future__ import annotations

import pytest
import torch

from grpo import paths
from grpo.config import config_from_dict
from grpo.model.loading import save_model
from grpo.provenance.lineage import make_lineage, write_lineage
from grpo.train.policy import build_policy


@pytest.mark.parametrize("lora", [True, False])
def test_policy_is_in_train_mode_and_checkpoints_its_layers(tmp_path, tiny_model, tiny_tokenizer, lora,
                                                            monkeypatch):
    """A loaded model is in eval mode, where gradient checkpointing and dropout do nothing: the policy
    of every weight (``model.lora.enabled: false``) as well as the adapter's must come back training,
    its decoder layers run through the checkpoint function."""
    import transformers.modeling_utils as checkpoint_module  # where gradient_checkpointing_enable finds it

    calls = []
    original = checkpoint_module.checkpoint
    monkeypatch.setattr(checkpoint_module, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data"), "models_dir": str(tmp_path / "models")},
                            "model": {"gradient_checkpointing": True, "lora": {"enabled": lora, "r": 2, "alpha": 4}}})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    for stage in ("base", "sft"):
        save_model(tiny_model, tiny_tokenizer, paths.model_dir(cfg, stage))
        write_lineage(paths.model_dir(cfg, stage), make_lineage(stage, cfg, paths.stage_inputs(cfg, stage)))
    model = build_policy(cfg, torch.device("cpu")).model
    assert model.training and model.is_gradient_checkpointing
    ids = tiny_tokenizer("a short text", return_tensors="pt").input_ids
    model(input_ids=ids).logits.float().sum().backward()
    assert len(calls) == tiny_model.config.num_hidden_layers


def test_the_adapter_drops_out_at_model_lora_dropout(tiny_model):
    from grpo.config import LoraConfig
    from grpo.model.lora import wrap_lora

    wrapped = wrap_lora(tiny_model, LoraConfig(dropout=0.25, target_modules=["v_proj"]))
    dropouts = [m for name, m in wrapped.named_modules() if name.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Dropout) and m.p == 0.25 for m in dropouts)
