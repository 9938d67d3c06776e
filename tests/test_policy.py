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


def _saved_sft(tmp_path, tiny_model, tiny_tokenizer, **params):
    """A config whose models/sft (and models/base) is the tiny model, with ``params`` merged in."""
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data"), "models_dir": str(tmp_path / "models")},
                            **params})
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text("")
    for stage in ("base", "sft"):
        save_model(tiny_model, tiny_tokenizer, paths.model_dir(cfg, stage))
        write_lineage(paths.model_dir(cfg, stage), make_lineage(stage, cfg, paths.stage_inputs(cfg, stage)))
    return cfg


def _rates(policy, steps: int) -> list[float]:
    """The learning rate of each of ``steps`` optimizer steps, as the scheduler sets it."""
    rates = []
    for _ in range(steps):
        rates.append(policy.optimizer.param_groups[0]["lr"])
        policy.optimizer.step()
        policy.scheduler.step()
    return rates


def test_the_learning_rate_warms_up_from_its_first_step_without_weight_decay(tmp_path, tiny_model, tiny_tokenizer):
    """``grpo.warmup_steps: 4``: the first update already moves at lr / 4 (a zero rate would waste the step),
    full lr from the fourth; AdamW's default decay would pull the weights towards 0, away from SFT's."""
    cfg = _saved_sft(tmp_path, tiny_model, tiny_tokenizer, grpo={"lr": 1e-3, "warmup_steps": 4},
                     model={"lora": {"r": 2, "alpha": 4}})
    policy = build_policy(cfg, torch.device("cpu"))
    assert _rates(policy, 5) == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert all(group["weight_decay"] == 0.0 for group in policy.optimizer.param_groups)


def test_every_build_draws_the_same_adapter_whatever_the_global_random_state(tmp_path, tiny_model, tiny_tokenizer):
    """Every process builds the policy: its LoRA init is drawn from ``seed``, or the processes start apart."""
    cfg = _saved_sft(tmp_path, tiny_model, tiny_tokenizer, model={"lora": {"r": 2, "alpha": 4}})
    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)  # another process's (or a resumed run's) global state
        model = build_policy(cfg, torch.device("cpu")).model
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n})
    assert adapters[0] and all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


def test_a_constant_learning_rate_without_warmup_starts_at_lr(tmp_path, tiny_model, tiny_tokenizer):
    """``grpo.warmup_steps: 0``: every update at the full rate, the first included."""
    cfg = _saved_sft(tmp_path, tiny_model, tiny_tokenizer, grpo={"lr": 1e-3, "warmup_steps": 0},
                     model={"lora": {"r": 2, "alpha": 4}})
    assert _rates(build_policy(cfg, torch.device("cpu")), 3) == pytest.approx([1e-3] * 3)


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_full_fine_tuning_keeps_a_frozen_sft_copy_as_the_reference_where_kl_is_on(
    tmp_path, tiny_model, tiny_tokenizer, beta
):
    """I9 without an adapter: under ``grpo.loss.beta`` > 0 the reference is a copy of the SFT weights in eval
    mode that no gradient reaches and no optimizer holds (else the KL would be taken against the policy
    itself, or the reference would drift with it); at beta 0 no copy is held (it would only take memory)."""
    cfg = _saved_sft(tmp_path, tiny_model, tiny_tokenizer, model={"lora": {"enabled": False}},
                     grpo={"loss": {"beta": beta}})
    policy = build_policy(cfg, torch.device("cpu"))
    if beta == 0:
        assert policy.reference is None
        return
    reference = policy.reference
    assert reference is not None and reference is not policy.model and not reference.training
    sft = tiny_model.state_dict()
    assert all(torch.equal(value, sft[name]) for name, value in reference.state_dict().items())
    assert not any(p.requires_grad for p in reference.parameters())
    held = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in policy.model.parameters()}
    assert not held & {id(p) for p in reference.parameters()}
