"""Tests of grpo/checks/diagnose.py: a collapsed and a healthy adapter trained here on a real tiny model.

The collapsed policy is trained with a huge NEGATIVE entropy coefficient (minimising
``-(-50) * entropy`` drives entropy to 0) and a high learning rate; the healthy one with the same
steps, coefficient 0 and a gentle learning rate.
LoRA covers ``lm_head`` too: on a randomly initialised tiny model the final norm bounds the logits,
so attention-only adapters could not collapse it in a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from grpo import paths
from grpo.checks.diagnose import Check, check_entropy_step, diagnose, make_probe
from grpo.checks.diagnosis_checks import check_target_lineage
from grpo.checks.diagnosis_target import DiagnoseError, load_target, target_kind
from grpo.cli import main
from grpo.config import Config, config_to_dict
from grpo.core.batching import join_prompt_completion
from grpo.core.logprobs import score_completions
from grpo.core.losses import policy_loss_terms, total_loss
from grpo.data.prompts import example_messages
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.fast import FastPaths
from grpo.model.loading import load_model, load_tokenizer, save_model
from grpo.model.lora import wrap_lora
from grpo.model.rollout import generate_rollout
from grpo.train import checkpoint as ckpt
from grpo.train.rng_state import capture_rng
from tests.eval_project import GROUP, build_project, make_records

TRAIN_STEPS = 8


def train_adapter(cfg: Config, entropy_coef: float, steps: int = TRAIN_STEPS, lr: float = 0.1, lora: bool = True):
    """A LoRA on the SFT weights (``lora=False``: every SFT weight) after ``steps`` Adam steps on the GRPO
    loss with random advantages."""
    torch.manual_seed(cfg.seed)
    model = load_model(paths.model_dir(cfg, "sft"), cfg.model)
    model = wrap_lora(model, cfg.model.lora) if lora else model
    tokenizer = load_tokenizer(paths.model_dir(cfg, "sft"), cfg.model)
    prompts = [render_prompt(tokenizer, example_messages(r)) for r in make_records("train", 2, 2, seed=1)]
    rollout = generate_rollout(model, tokenizer, prompts, GROUP, cfg.grpo.sampling, end_of_turn_ids(tokenizer), 0,
                               fast=FastPaths())
    joined = join_prompt_completion(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    advantages = torch.randn(len(rollout.texts), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        scored = score_completions(model, joined.input_ids, joined.attention_mask, rollout.completion_ids.shape[1],
                                   cfg.grpo.sampling.temperature)
        terms, _ = policy_loss_terms(scored.logprobs, scored.logprobs.detach(), None, advantages,
                                     rollout.completion_mask, scored.entropy, epsilon_low=0.2, epsilon_high=0.28,
                                     loss_type="grpo", max_completion_length=cfg.grpo.sampling.max_new_tokens)
        loss = total_loss(terms, beta=0.0, entropy_coef=entropy_coef)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Config:
    return build_project(tmp_path_factory.mktemp("diagnose"))


@pytest.fixture(scope="module")
def collapsed_checkpoint(project) -> Path:
    model, _ = train_adapter(project, entropy_coef=-50.0)
    return ckpt.save_checkpoint(paths.run_dir(project), TRAIN_STEPS, model=model, optimizer=None, scheduler=None,
                                rng=capture_rng(), history=[], lineage={}, keep_last=2)


@pytest.fixture(scope="module")
def healthy_adapter(project) -> Path:
    model, tokenizer = train_adapter(project, entropy_coef=0.0, lr=0.01)
    out = Path(project.paths.models_dir) / "healthy"
    save_model(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def fresh(project):
    """The SFT model with a fresh adapter, and its probe."""
    target = load_target(project, paths.model_dir(project, "sft"))
    return target, make_probe(project, target)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


# ---------------------------------------------------------------------------- acceptance


def test_collapsed_checkpoint_fails_the_collapse_check_via_cli(project, collapsed_checkpoint, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(config_to_dict(project)), encoding="utf-8")
    out = tmp_path / "diagnosis.json"
    code = main(["diagnose", str(collapsed_checkpoint), "--params", str(params), "--out", str(out)])
    report = json.loads(out.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert code == 1 and report["kind"] == "checkpoint"
    assert checks["entropy_collapse"]["status"] == "fail"
    assert checks["entropy_collapse"]["value"] < project.eval.diagnose.entropy_floor
    assert "entropy_collapse" in report["failed"] and checks["entropy_collapse"]["hint"]


def test_healthy_adapter_passes_the_collapse_check(project, healthy_adapter):
    target, checks = diagnose(project, healthy_adapter, progress=False)
    checks = by_name(checks)
    assert target.kind == "adapter" and not target.fresh
    assert checks["entropy_collapse"].status == "pass", checks["entropy_collapse"].detail
    assert checks["entropy_collapse"].value > project.eval.diagnose.entropy_floor
    assert checks["kl_init"].status in ("pass", "warn") and checks["kl_init"].value > 0  # trained: moved
    assert checks["lora_gradients"].status == "pass"
    # Saved without lineage.json: reported, not refused.
    assert checks["lineage"].status == "warn" and "lineage" in checks["lineage"].detail


# ---------------------------------------------------------------------------- fresh adapter on a full model


def test_fresh_adapter_on_sft_passes_the_plumbing_checks(project):
    target, checks = diagnose(project, paths.model_dir(project, "sft"), progress=False)
    checks = by_name(checks)
    assert target.kind == "model" and target.fresh
    assert list(checks) == ["lineage", "entropy_collapse", "reward_degeneracy", "advantages", "lora_gradients",
                            "temperature_entropy", "kl_init", "entropy_step"]
    assert checks["lineage"].status == "pass", checks["lineage"].detail
    assert checks["entropy_collapse"].status == "pass"  # adapter off == adapter on: ratio 1
    assert checks["kl_init"].status == "pass" and checks["kl_init"].value == pytest.approx(0.0, abs=1e-6)
    assert checks["lora_gradients"].status == "pass" and checks["lora_gradients"].value > 0
    values = checks["temperature_entropy"].value
    assert checks["temperature_entropy"].status == "pass" and values == sorted(values) and len(values) == 3
    assert checks["entropy_step"].status == "pass" and checks["entropy_step"].value > 0
    assert 0.0 <= checks["reward_degeneracy"].value <= 1.0


def lora_off(cfg: Config) -> Config:
    """``cfg`` with ``model.lora.enabled: false``: GRPO trains every weight against a frozen SFT copy."""
    lora = cfg.model.lora.model_copy(update={"enabled": False})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})


def test_full_weights_start_passes_the_plumbing_checks(project):
    """``model.lora.enabled: false`` on models/sft: the policy is every SFT weight, the reference a frozen
    copy; the gradient check covers every weight and the KL to the reference starts at exactly 0."""
    target, checks = diagnose(lora_off(project), paths.model_dir(project, "sft"), progress=False)
    checks = by_name(checks)
    assert target.fresh and not target.lora and not hasattr(target.model, "disable_adapter")
    assert list(checks) == ["lineage", "entropy_collapse", "reward_degeneracy", "advantages", "gradients",
                            "temperature_entropy", "kl_init", "entropy_step"]
    n_weights = sum(1 for _ in target.model.parameters())
    assert checks["gradients"].status == "pass" and f"over {n_weights} trainable tensors" in checks["gradients"].detail
    assert checks["kl_init"].status == "pass" and checks["kl_init"].value == 0.0
    assert checks["entropy_collapse"].status == "pass" and checks["temperature_entropy"].status == "pass"
    assert checks["entropy_step"].status == "pass" and checks["entropy_step"].value > 0


def test_full_weights_checkpoint_and_model_are_diagnosed_against_the_sft_weights(project, tmp_path):
    """A checkpoint of every weight (via the CLI) and a fully trained models/grpo-like folder (lineage of
    stage grpo): both are scored against the SFT weights, so their KL to the reference is > 0."""
    from grpo.provenance.lineage import make_lineage, write_lineage

    cfg = lora_off(project)
    model, tokenizer = train_adapter(cfg, entropy_coef=0.0, steps=4, lr=0.01, lora=False)
    checkpoint = ckpt.save_checkpoint(tmp_path / "runs", 4, model=model, optimizer=None, scheduler=None,
                                      rng=capture_rng(), history=[], lineage={}, keep_last=2)
    params, out = tmp_path / "params.yaml", tmp_path / "diagnosis.json"
    params.write_text(yaml.safe_dump(config_to_dict(cfg)), encoding="utf-8")
    main(["diagnose", str(checkpoint), "--params", str(params), "--out", str(out)])
    checks = {check["name"]: check for check in json.loads(out.read_text())["checks"]}
    assert checks["gradients"]["status"] == "pass" and checks["kl_init"]["value"] > 0
    folder = tmp_path / "grpo"
    save_model(model, tokenizer, folder)
    write_lineage(folder, make_lineage("grpo", cfg, {}))
    target, by = diagnose(cfg, folder, progress=False)
    assert target.kind == "model" and not target.fresh and target.reference is not None
    assert by_name(by)["kl_init"].value == pytest.approx(checks["kl_init"]["value"], rel=1e-4)


def test_base_model_lineage_is_checked_and_a_folder_without_one_is_skipped(project, tmp_path):
    base = Path(project.paths.models_dir) / "base"
    assert check_target_lineage(load_target(project, base)).status == "pass"
    changed = project.model_copy(update={"seed": project.seed + 1})
    stale = check_target_lineage(load_target(changed, base))
    assert stale.status == "warn" and "models/base is stale" in stale.detail and "seed" in stale.detail
    shutil.copytree(base, tmp_path / "elsewhere", ignore=shutil.ignore_patterns("lineage.json"))
    assert check_target_lineage(load_target(project, tmp_path / "elsewhere")).status == "skip"


def test_entropy_step_restores_weights_and_warns_on_negative_configured_coef(project, fresh):
    target, probe = fresh
    before = {n: p.detach().clone() for n, p in target.model.named_parameters() if p.requires_grad}
    negative = project.model_copy(update={"grpo": project.grpo.model_copy(
        update={"loss": project.grpo.loss.model_copy(update={"entropy_coef": -0.1})})})
    check = check_entropy_step(negative, target, probe)
    assert check.status == "warn" and check.value > 0 and "entropy_coef=-0.1" in check.hint
    after = dict(target.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in before.items())
    assert all(after[n].grad is None for n in before)


def test_probe_shapes_and_task_mix(project, fresh):
    _, probe = fresh
    n_rows = project.eval.diagnose.prompts * GROUP
    assert probe.input_ids.shape[0] == n_rows and probe.completion_mask.shape[0] == n_rows
    assert probe.input_ids.shape[1] == probe.rollout.prompt_ids.shape[1] + probe.completion_mask.shape[1]
    assert [r["task"] for r in probe.records] == ["fairness", "hallucination"]


def test_target_kind_and_unknown_folder(project, tmp_path):
    assert target_kind(paths.model_dir(project, "sft")) == "model"
    (tmp_path / "checkpoint-00000003").mkdir()
    assert target_kind(tmp_path / "checkpoint-00000003") == "checkpoint"
    with pytest.raises(DiagnoseError, match="not a model folder"):
        target_kind(tmp_path)
    with pytest.raises(DiagnoseError, match="no such folder"):
        load_target(project, tmp_path / "missing")


def test_a_nan_gradient_fails(project, fresh, monkeypatch):
    from grpo.checks import diagnose as diagnose_module

    target, probe = fresh
    advantages = torch.ones(probe.completion_mask.shape[0])
    assert diagnose_module.check_gradients(project, target, probe, advantages).status == "pass"
    monkeypatch.setattr(diagnose_module, "_grad_norm", lambda params: float("nan"))
    check = diagnose_module.check_gradients(project, target, probe, advantages)
    assert check.status == "fail" and check.value != check.value  # NaN


def test_a_fresh_adapter_is_held_to_kl_init_tol_not_kl_warn(project, fresh, monkeypatch):
    from grpo.checks import diagnose as diagnose_module

    target, probe = fresh
    d = project.eval.diagnose
    assert target.fresh and d.kl_init_tol < 0.5 < d.kl_warn
    monkeypatch.setattr(diagnose_module, "reference_kl", lambda *args: 0.5)  # a reference that is not the start
    assert diagnose_module.check_kl_init(project, target, probe).status == "fail"


def test_temperatures_listed_high_to_low_are_compared_in_order(project, fresh):
    from grpo.checks.diagnose import check_temperature

    target, probe = fresh
    temps = sorted(project.eval.diagnose.temperatures, reverse=True)
    backwards = project.model_copy(update={"eval": project.eval.model_copy(
        update={"diagnose": project.eval.diagnose.model_copy(update={"temperatures": temps})})})
    check = check_temperature(backwards, target, probe)
    assert check.status == "pass" and check.detail.startswith(f"T={temps[-1]}:")


def test_diagnose_exits_1_on_a_failed_check_only(project, tmp_path, monkeypatch, capsys):
    from grpo.checks import diagnose as diagnose_module
    from grpo.checks.diagnosis_target import Target

    target = Target(None, None, "model", tmp_path, True, [])
    calm = [Check("kl_init", "warn", 0.0, "moved nothing"), Check("lineage", "skip", None, "no lineage"),
            Check("gradients", "pass", 1.0, "fine")]
    monkeypatch.setattr(diagnose_module, "diagnose", lambda cfg, path: (target, calm))
    assert diagnose_module.run(project, str(tmp_path)) == 0
    assert "diagnose: no check failed" in capsys.readouterr().out
    monkeypatch.setattr(diagnose_module, "diagnose", lambda cfg, path: (target, [*calm, Check("x", "fail", 1, "")]))
    assert diagnose_module.run(project, str(tmp_path)) == 1


def test_a_stage_folder_is_known_however_its_path_is_written(project, collapsed_checkpoint, monkeypatch):
    """models/sft given by another spelling of its path, and a checkpoint on it, are checked against the
    current params: a stale SFT model is named either way."""
    changed = project.model_copy(update={"seed": project.seed + 1})
    sft = paths.model_dir(project, "sft")
    monkeypatch.chdir(sft.parent)
    for spelling in (sft, Path("sft"), sft / ".." / "sft"):
        stale = load_target(changed, spelling).stale
        assert any("models/sft is stale" in line for line in stale), (spelling, stale)
    assert any("models/sft is stale" in line for line in load_target(changed, collapsed_checkpoint).stale)


def test_a_zero_gradient_fails(project, fresh, monkeypatch):
    """A loss that reaches no trained weight (norm exactly 0) is a broken wiring, not a vanishing gradient."""
    from grpo.checks import diagnose as diagnose_module

    target, probe = fresh
    monkeypatch.setattr(diagnose_module, "_grad_norm", lambda params: 0.0)
    check = diagnose_module.check_gradients(project, target, probe, torch.ones(probe.completion_mask.shape[0]))
    assert check.status == "fail" and check.value == 0.0


def test_the_gradient_norm_is_the_l2_norm_over_every_tensor():
    from grpo.checks.diagnose import _grad_norm

    first, second, untouched = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    first.grad, second.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    assert _grad_norm([first, second, untouched]) == pytest.approx(5.0)


def test_real_advantages_with_zero_rows_are_used_as_they_are(project, fresh):
    """Only all-zero advantages are replaced by the +-1 probe; a batch where one group had reward variance
    keeps its own advantages (their gradient differs from the probe's)."""
    from grpo.checks.diagnose import check_gradients

    target, probe = fresh
    n = probe.completion_mask.shape[0]
    one_row = torch.zeros(n)
    one_row[0] = 1.0
    real = check_gradients(project, target, probe, one_row)
    probing = check_gradients(project, target, probe, torch.zeros(n))
    assert "probe advantages" not in real.detail and "probe advantages" in probing.detail
    assert real.value != pytest.approx(probing.value, rel=1e-3)


def test_entropy_falling_between_any_two_temperatures_fails(project, fresh, monkeypatch):
    from grpo.checks import diagnose as diagnose_module

    target, probe = fresh
    temps = sorted(project.eval.diagnose.temperatures)
    assert len(temps) == 3
    entropy = dict(zip(temps, (1.0, 0.5, 2.0), strict=True))  # rises overall, falls at the middle step
    monkeypatch.setattr(diagnose_module, "mean_entropy", lambda model, inputs: entropy[inputs.temperature])
    check = diagnose_module.check_temperature(project, target, probe)
    assert check.status == "fail" and check.value == [1.0, 0.5, 2.0]


@pytest.mark.parametrize("where, status", [("below_init_tol", "warn"), ("between", "pass"), ("above_warn", "warn")])
def test_a_trained_policy_warns_when_it_never_moved_or_drifted_past_kl_warn(project, fresh, monkeypatch, where,
                                                                          status):
    from grpo.checks import diagnose as diagnose_module

    target, probe = fresh
    d = project.eval.diagnose
    kl = {"below_init_tol": d.kl_init_tol / 2, "between": (d.kl_init_tol + d.kl_warn) / 2,
          "above_warn": 2 * d.kl_warn}[where]
    monkeypatch.setattr(diagnose_module, "reference_kl", lambda *args: kl)
    check = diagnose_module.check_kl_init(project, dataclasses.replace(target, fresh=False), probe)
    assert check.status == status and check.value == kl
