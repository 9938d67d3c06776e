"""grpo/checks/preflight.py: the invariant checks on the configured tokenizer and model, and the train gate."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from grpo.checks.gated import perturbed_policy
from grpo.checks.preflight import CHECKS, report_path, run_checks_on
from grpo.cli import main
from grpo.config import config_from_dict, load_config
from grpo.data.prepare import build_records
from grpo.model.chat import ChatError
from grpo.model.lora import wrap_lora
from grpo.model.precision import cpu_has_native_bf16
from grpo.provenance.gate import PreflightError, require_preflight
from grpo.train.policy import frozen_copy
from tests.gate_subjects import CFG, FULL, random_model_for, subject_for
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def records():
    cfg = config_from_dict({"data": {"n_train": 12, "n_eval": 4}})
    return [r.model_dump(mode="json") for r in build_records(cfg)["train"]]


def test_every_check_passes_on_every_tokenizer(any_tokenizer, records):
    """Tiny, Llama-3.2 (pad == eot), Qwen2.5 (pad != eos, default system prompt), Phi-3 (<|end|> != eos)."""
    cfg = CFG
    if "Cutting Knowledge" in (any_tokenizer.chat_template or ""):
        cfg = config_from_dict({**cfg.model_dump(mode="json"),
                                "model": {**cfg.model.model_dump(mode="json"),
                                          "chat_template_kwargs": {"date_string": "26 Jul 2024"}}})
    subject = subject_for(cfg, random_model_for(any_tokenizer), any_tokenizer, records)
    assert len(subject.prompts[0]) < len(subject.prompts[1]), "the batch must actually be left-padded"
    checks = run_checks_on(subject)
    assert [c.name for c in checks] == [f.__name__.removeprefix("check_") for f in CHECKS]
    failed = {c.name: (c.detail, c.value) for c in checks if not c.passed}
    # A random model never learnt to end its answers: the one check a real SFT model must pass here.
    assert set(failed) <= {"sft_ends_answers"}, failed
    assert all(c.bound is not None for c in checks), "every check reports the bound it compared with"


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16: grpo.bf16 runs fp32 here")
def test_every_check_passes_under_bf16_autocast_with_its_bound(tiny_tokenizer, records):
    """``grpo.bf16`` on a bf16 CPU: the checks run the step's bf16 path with the same bounds as fp32 (the
    checks compare on the step's own forwards, or in fp32), and the step's passes agree bit for bit."""
    cfg = config_from_dict({**CFG.model_dump(mode="json"), "grpo": {**CFG.grpo.model_dump(mode="json"), "bf16": True}})
    subject = subject_for(cfg, random_model_for(tiny_tokenizer), tiny_tokenizer, records)
    fp32 = subject_for(CFG, random_model_for(tiny_tokenizer), tiny_tokenizer, records)
    assert subject.tolerance() == fp32.tolerance() == 1e-4
    with subject.step.autocast():
        assert torch.is_autocast_enabled("cpu")
    checks = {c.name: c for c in run_checks_on(subject)}
    assert {n: (c.detail, c.value) for n, c in checks.items() if not c.passed} .keys() <= {"sft_ends_answers"}
    assert checks["first_step"].value == 0.0  # ratio 1 and KL 0 exactly: the reference pass is the update's
    assert checks["ratio_kl_reference"].value["ref_vs_fresh_sft"] == 0.0
    assert checks["temperature"].value <= 1e-4


def full_subject(tokenizer, records, base_as_reference: bool = False):
    """The checks' subject with ``model.lora.enabled: false``: every weight of a random model is the
    policy, a frozen copy of it the reference (as ``build_policy`` makes them), the same model with
    halved weights the pre-SFT base (``base_as_reference``: the I9 bug, the base is the reference)."""
    model = random_model_for(tokenizer)
    base = random_model_for(tokenizer)
    with torch.no_grad():
        for p in base.parameters():
            p.mul_(0.5)
    reference = frozen_copy(base if base_as_reference else model)
    return subject_for(FULL, model, tokenizer, records, copy.deepcopy(model), base, reference)


def test_every_check_passes_with_lora_off(tiny_tokenizer, records):
    """Full fine-tuning: the step scores the frozen reference (no adapter to disable), the perturbed
    policy moves away from it (KL > 0) and every check passes."""
    subject = full_subject(tiny_tokenizer, records)
    assert not hasattr(subject.policy, "disable_adapter") and subject.reference is not None
    checks = {c.name: c for c in run_checks_on(subject)}
    assert {name: (c.detail, c.value) for name, c in checks.items() if not c.passed}.keys() <= {"sft_ends_answers"}
    numbers = checks["ratio_kl_reference"].value
    assert numbers["kl_perturbed"] > 0 and numbers["ref_vs_base"] > numbers["ref_vs_fresh_sft"]


def test_i9_with_lora_off_catches_the_base_as_the_reference(tiny_tokenizer, records):
    """The I9 check fails when the frozen reference is the pre-SFT base instead of the SFT weights."""
    wrong = full_subject(tiny_tokenizer, records, base_as_reference=True)
    check = next(c for c in run_checks_on(wrong) if c.name == "ratio_kl_reference")
    assert check.status == "fail" and "the reference is not the SFT weights (I9)" in check.detail
    assert check.value["ref_vs_base"] <= check.bound["ref_vs_fresh_sft"]


def test_perturbed_policy_moves_every_trainable_weight_and_restores_it_bit_exactly(tiny_tokenizer):
    """Full weights: each trainable weight moves by about 5% of its own spread; LoRA: only the B matrices
    move (from 0). Both come back bit-exactly."""
    model = random_model_for(tiny_tokenizer)
    model.model.embed_tokens.weight.requires_grad_(False)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with perturbed_policy(model, seed=3):
        for name, p in model.named_parameters():
            change = (p - saved[name]).abs().mean()
            if not p.requires_grad:
                assert change == 0, name
                continue
            spread = saved[name].std() if saved[name].std() > 0 else saved[name].abs().mean()
            assert 0.01 * spread < change < 0.1 * spread, name
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    torch.manual_seed(0)
    lora = wrap_lora(random_model_for(tiny_tokenizer), CFG.model.lora)
    saved = {n: p.detach().clone() for n, p in lora.named_parameters()}
    with perturbed_policy(lora, seed=3):
        moved = {n for n, p in lora.named_parameters() if not torch.equal(p, saved[n])}
    assert moved and all("lora_B" in n for n in moved)
    assert all(torch.equal(p, saved[n]) for n, p in lora.named_parameters())


def test_template_drift_fails_render_parity(tiny_tokenizer, records):
    """A template whose generation prompt differs from its rendered assistant turn (the SFT/RL drift
    bug) stops the pre-flight with the drift named, before any training."""
    tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer,
                                         **tiny_tokenizer.special_tokens_map)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = tiny_tokenizer.chat_template.replace(
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}", "{{ '<|start_header_id|>assistant:\n' }}")
    assert tokenizer.chat_template != tiny_tokenizer.chat_template
    with pytest.raises(ChatError, match="drift"):
        run_checks_on(subject_for(CFG, random_model_for(tokenizer), tokenizer, records))


def test_train_refuses_without_a_passing_preflight_for_the_current_lineage(tmp_path):
    params = prepared_project(tmp_path / "p")
    cfg = load_config(params)
    report = json.loads(report_path(cfg).read_text())
    assert report["passed"] and all(c["passed"] for c in report["checks"])
    require_preflight(cfg)  # passes as made
    # Another multitask mode changes what the entropy-sign check ran: the report no longer counts.
    with pytest.raises(PreflightError, match="grpo preflight"):
        require_preflight(load_config(params, ["grpo.multitask.mode=pcgrad"]))
    # A changed step count does not touch the checks: the report still counts.
    require_preflight(load_config(params, ["grpo.steps=99"]))
    # A new precision or loss changes what the checks ran too (stages.PREFLIGHT_GRPO_KEYS).
    for override in ("grpo.bf16=true", "grpo.shared_prefix=false", "grpo.loss.beta=0.5"):
        with pytest.raises(PreflightError, match="grpo preflight"):
            require_preflight(load_config(params, [override]))
    text = report_path(cfg).read_text()
    failing = report["checks"][0]["name"]
    checks = [dict(c, passed=c["name"] != failing) for c in report["checks"]]
    report_path(cfg).write_text(json.dumps(dict(report, passed=False, checks=checks)))
    with pytest.raises(PreflightError, match=rf"pre-flight failed \({failing}\); fix them"):
        require_preflight(cfg)  # a failed report for the very same lineage
    report_path(cfg).write_text(json.dumps(dict(report, checks=checks)))  # "passed" contradicted by a check
    with pytest.raises(PreflightError, match=rf"pre-flight failed \({failing}\)"):
        require_preflight(cfg)
    report_path(cfg).write_text(text[: len(text) // 2])  # a report cut short
    with pytest.raises(PreflightError, match="is not a pre-flight report .*grpo preflight"):
        require_preflight(cfg)
    report_path(cfg).unlink()
    with pytest.raises(PreflightError, match="does not exist"):
        require_preflight(cfg)


def test_preflight_passes_and_train_runs_with_lora_off(tmp_path):
    """``model.lora.enabled: false`` end to end through the CLI: the pre-flight passes on the fully
    trainable SFT model with its frozen reference, and the gated ``grpo train`` takes a step."""
    root = tmp_path / "full"
    params = prepared_project(root, model={"lora": {"enabled": False}})
    cfg = load_config(params)
    report = json.loads(report_path(cfg).read_text())
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    ratio = next(c for c in report["checks"] if c["name"] == "ratio_kl_reference")
    assert ratio["value"]["kl_perturbed"] > 0
    # `grpo train` requires the passing pre-flight of this lineage (grpo/provenance/gate.py)
    assert main(["train", "--params", str(params), "--max-steps", "1"]) == 0
    checkpoint = root / "runs" / "tiny" / "checkpoint-00000001"
    assert (checkpoint / "lineage.json").is_file()
    # beta 0: the trainer keeps no reference, the I8/I9 probe still gets the frozen copy build_policy makes
    assert main(["preflight", "--params", str(params), "--set", "grpo.loss.beta=0"]) == 0
