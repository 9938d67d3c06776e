"""No false refusal: ``grpo preflight`` passes correct code under every user-facing setting (grpo/config/train.py,
docs/configuration.md), one setting changed at a time from the tiny project's, on its SFT model.

Each row is a setting a user may pick; the gate must run its own checks under it (the step it builds is the
step that setting trains) and pass them all: a refusal here is a gate that stops correct code.
"""

from __future__ import annotations

import json

import pytest

from grpo import paths
from grpo.cli import main
from grpo.config import load_config
from grpo.model.precision import cpu_has_native_bf16
from tests.test_trainer import copy_project
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow

SETTINGS = (
    "grpo.dynamic_sampling=filter",
    "grpo.dynamic_sampling=resample",
    "grpo.loss.scale_rewards=batch",
    "grpo.loss.scale_rewards=none",
    "grpo.loss.loss_type=dr_grpo",
    "grpo.loss.loss_type=token_mean",
    "grpo.multitask.mode=sum",
    "grpo.multitask.mode=pcgrad",
    "grpo.multitask.reward_only=true",
    "grpo.multitask.low_memory=true",
    "grpo.sampling.presence_penalty=0.5",
    "grpo.sampling.frequency_penalty=0.5",
    "grpo.sampling.temperature=0.7",
    "grpo.sampling.top_p=0.9",
    "grpo.sampling.top_k=20",
    "grpo.sampling.min_new_tokens=0",
    "grpo.num_iterations=2",
    "grpo.bf16=true",
    "grpo.shared_prefix=false",
    "grpo.full_logits=true",
    "model.fast_paths=off",
)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The tiny project with data, base, SFT and the default settings' passing pre-flight."""
    return prepared_project(tmp_path_factory.mktemp("settings"))


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_gate_passes_correct_code_under_each_setting(project, setting, tmp_path):
    """A ``model.*`` setting is one the base and SFT models are built with (their lineage names it): those
    stages run again under it, in a copy of the project, as ``dvc repro`` would."""
    if setting == "grpo.bf16=true" and not cpu_has_native_bf16():
        pytest.skip("grpo.bf16 runs fp32 on a CPU without native bf16 (the default's run)")
    if setting.startswith("model."):
        project = copy_project(project, tmp_path / "copy")
        for stage in ("base", "sft"):
            assert main([stage, "--params", str(project), "--set", setting]) == 0
    code = main(["preflight", "--params", str(project), "--set", setting])
    report = json.loads(paths.report_file(load_config(project), "preflight.json").read_text())
    failed = {c["name"]: c["detail"][:600] for c in report["checks"] if not c["passed"]}
    assert code == 0 and not failed, f"{setting}: the gate refused correct code: {failed}"
