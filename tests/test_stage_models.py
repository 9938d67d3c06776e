"""grpo/model/stage_models.py: the base model is refused when stale, by every stage that reads it (I12)."""

from __future__ import annotations

import shutil

import pytest
import torch

from grpo import paths
from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.model.stage_models import check_sft, load_base
from grpo.provenance.lineage import StaleArtifactError, make_lineage, write_lineage
from grpo.train import pretrain, sft

TINY = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _cfg(tmp_path, hidden_size: int):
    return config_from_dict({
        "paths": {name: str(tmp_path / name) for name in ("data_dir", "models_dir", "metrics_dir")},
        "data": {"n_train": 16, "n_eval": 4}, "model": {"tiny": TINY | {"hidden_size": hidden_size}},
        "pretrain": {"records": 0}, "sft": {"epochs": 1},
    })


def test_a_stale_base_is_refused_by_sft_and_under_a_current_looking_sft(tmp_path):
    """A base built under other params is refused by ``load_base`` (so ``grpo sft`` trains nothing on it),
    and ``check_sft`` refuses an SFT model whose own lineage matches the params but whose base is stale:
    SFT's lineage holds the base's content, not whether that base is current."""
    built, changed = _cfg(tmp_path, 32), _cfg(tmp_path, 64)
    assert prepare.run(built) == 0 and pretrain.run(built) == 0
    load_base(built)
    with pytest.raises(StaleArtifactError, match=r"model\.tiny.*hidden_size"):
        load_base(changed)
    with pytest.raises(StaleArtifactError, match=r"model\.tiny"):
        sft.run(changed)
    assert not paths.model_dir(changed, "sft").exists()
    # An SFT folder recorded as built under the changed params from this (stale) base.
    shutil.copytree(paths.model_dir(built, "base"), paths.model_dir(changed, "sft"))
    write_lineage(paths.model_dir(changed, "sft"), make_lineage("sft", changed, paths.stage_inputs(changed, "sft")))
    with pytest.raises(StaleArtifactError, match=r"model\.tiny"):
        check_sft(changed)
    write_lineage(paths.model_dir(built, "sft"), make_lineage("sft", built, paths.stage_inputs(built, "sft")))
    check_sft(built)


def _weights(cfg, stage):
    from safetensors.torch import load_file

    return load_file(paths.model_dir(cfg, stage) / "model.safetensors")


def test_sft_trains_every_weight_or_a_seeded_merged_adapter_as_sft_lora_says(tmp_path):
    """``sft.lora`` alone decides (``model.lora.enabled`` is GRPO's switch): without it every weight moves;
    with it only the adapted projections (``model.lora.target_modules``) move, the same way on every run."""
    def cfg(name, lora):
        built = _cfg(tmp_path / name, 32)
        return built.model_copy(update={"sft": built.sft.model_copy(update={"lora": lora})})

    full, merged, again = cfg("full", False), cfg("merged", True), cfg("again", True)
    assert full.model.lora.enabled
    for run in (full, merged, again):
        assert prepare.run(run) == 0 and pretrain.run(run) == 0 and sft.run(run) == 0
    base = _weights(full, "base")
    moved = {run: {k for k, v in _weights(cfg_, "sft").items() if not torch.equal(v, base[k])}
             for run, cfg_ in (("full", full), ("merged", merged))}
    assert any(".mlp." in k for k in moved["full"]) and any("q_proj" in k for k in moved["full"])
    targets = tuple(merged.model.lora.target_modules)
    assert moved["merged"] and all(k.split(".")[-2] in targets for k in moved["merged"]), moved["merged"]
    assert all(torch.equal(v, _weights(again, "sft")[k]) for k, v in _weights(merged, "sft").items())


def test_the_grpo_adapter_sits_on_the_sft_weights_and_a_stale_base_under_it_is_refused(tmp_path):
    """``load_grpo`` puts the adapter on the SFT model (here SFT differs from base), and ``check_grpo`` refuses
    a GRPO model whose own lineage is current when the SFT model under it is not (its base is stale)."""
    from grpo.model.loading import load_model, load_tokenizer, save_model
    from grpo.model.lora import adapter_disabled
    from grpo.model.stage_models import check_grpo, load_grpo
    from tests.eval_project import add_grpo_adapter, build_project

    cfg = build_project(tmp_path)
    sft_dir = paths.model_dir(cfg, "sft")
    sft_model = load_model(sft_dir, cfg.model)
    with torch.no_grad():
        for param in sft_model.parameters():
            param.add_(0.01)
    save_model(sft_model, load_tokenizer(sft_dir, cfg.model), sft_dir)
    write_lineage(sft_dir, make_lineage("sft", cfg, paths.stage_inputs(cfg, "sft")))
    add_grpo_adapter(cfg)
    policy, _ = load_grpo(cfg)
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad(), adapter_disabled(policy):
        torch.testing.assert_close(policy(ids).logits, sft_model(ids).logits, rtol=0, atol=1e-6)
    check_grpo(cfg)
    changed = cfg.model_copy(update={"seed": cfg.seed + 1})
    write_lineage(paths.model_dir(cfg, "base"), make_lineage("base", changed, paths.stage_inputs(changed, "base")))
    with pytest.raises(StaleArtifactError):
        check_grpo(cfg)


def test_sft_records_its_lineage_and_the_metrics_of_the_steps_it_took(tmp_path, capsys):
    """What ``grpo sft`` leaves beside its weights: the lineage the later stages check (``check_sft``), the
    summary of its first and last step (``metrics/sft.json``, DVC's metrics) and every step's record
    (``metrics/sft_history.json``)."""
    import json

    built = _cfg(tmp_path, 32)
    cfg = built.model_copy(update={"sft": built.sft.model_copy(update={"epochs": 3})})
    assert prepare.run(cfg) == 0 and pretrain.run(cfg) == 0
    capsys.readouterr()
    assert sft.run(cfg) == 0
    check_sft(cfg)
    history = json.loads(paths.metrics_file(cfg, "sft_history").read_text())
    summary = json.loads(paths.metrics_file(cfg, "sft").read_text())
    assert len(history) >= 2 and history[0]["loss"] != history[-1]["loss"]
    assert summary["loss_first"] == history[0]["loss"] and summary["loss_final"] == history[-1]["loss"]
    assert summary["token_accuracy_final"] == history[-1]["token_accuracy"]
    assert summary["steps"] == len(history) and summary["examples"] == 16
    assert 0 < summary["wall_time_s"] < 600
    assert paths.metrics_file(cfg, "sft").read_text() == json.dumps(summary, indent=2) + "\n"
    out = capsys.readouterr().out
    assert f"sft: {len(history)} steps in " in out and str(paths.model_dir(cfg, "sft")) in out


def test_each_trained_model_is_refused_when_its_own_lineage_is_stale_and_a_cut_adapter_is_named(tmp_path):
    """The base current and SFT's own params changed: ``check_sft`` and ``load_sft`` refuse the SFT model;
    SFT current and GRPO's params changed: ``check_grpo`` and ``load_grpo`` refuse the GRPO model; an adapter
    file cut short is named by its path before PEFT reads it."""
    from grpo.model.loading import ModelLoadError
    from grpo.model.stage_models import check_base, check_grpo, load_grpo, load_sft
    from tests.eval_project import add_grpo_adapter, build_project

    cfg = build_project(tmp_path)
    adapter = add_grpo_adapter(cfg)
    check_grpo(cfg)
    sft_changed = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"lr": cfg.sft.lr * 2})})
    check_base(sft_changed)
    for refuse in (check_sft, load_sft):
        with pytest.raises(StaleArtifactError, match=r"sft\.lr"):
            refuse(sft_changed)
    grpo_changed = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"lr": cfg.grpo.lr * 2})})
    check_sft(grpo_changed)
    for refuse in (check_grpo, load_grpo):
        with pytest.raises(StaleArtifactError, match=r"grpo\.lr"):
            refuse(grpo_changed)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=rf"{weights}: not a whole safetensors file"):
        load_grpo(cfg)
