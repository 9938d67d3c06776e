"""Tests of grpo/checks/diagnosis_checks.py: the diagnosis's checks on given numbers, thresholds by table."""

from __future__ import annotations

import pytest
import torch

from grpo.checks.diagnosis_checks import (
    check_advantages,
    check_collapse,
    check_reward_degeneracy,
    check_target_lineage,
)
from grpo.checks.diagnosis_target import Target, _stale
from grpo.config import Config
from tests.eval_project import project_cfg


@pytest.fixture
def project(tmp_path) -> Config:
    return project_cfg(tmp_path)


@pytest.mark.parametrize(
    ("policy", "reference", "status"),
    [(5.0, 6.0, "pass"), (2.0, 6.0, "warn"), (1.0, 6.0, "fail"), (0.01, 0.011, "fail"),
     (0.04, 0.06, "fail"), (0.06, 0.04, "pass")],  # the floor is the policy's, not the reference's
)
def test_collapse_thresholds(project, policy, reference, status):
    """ratio >= 0.5 pass; 0.2 <= ratio < 0.5 warn; ratio < 0.2 or entropy < 0.05 fail."""
    check = check_collapse(project, policy, reference, temperature=1.0)
    assert check.status == status and check.value == policy
    assert bool(check.hint) == (status != "pass")


@pytest.mark.parametrize(("share", "status"), [(0.0, "pass"), (0.5, "warn"), (0.95, "fail"), (1.0, "fail")])
def test_reward_degeneracy_thresholds(project, share, status):
    check = check_reward_degeneracy(project, {"frac_reward_zero_std": share, "reward": -1.0}, 4)
    assert check.status == status and check.value == share
    assert f"{round(share * 4)} of 4 groups" in check.detail


def test_advantages_nan_and_all_zero_fail():
    assert check_advantages(torch.tensor([0.5, -0.5])).status == "pass"
    assert check_advantages(torch.tensor([float("nan"), 0.0])).status == "fail"
    assert check_advantages(torch.tensor([float("inf"), 0.0])).status == "fail"
    zero = check_advantages(torch.zeros(4))
    assert zero.status == "fail" and zero.value == 0.0



def test_a_stale_target_names_every_code_and_params_change(project, tmp_path):
    from grpo.provenance.lineage import make_lineage, write_lineage

    old = project.model_copy(update={"seed": project.seed + 1})
    lineage = make_lineage("grpo", old, {})
    changed = sorted(lineage["modules"])[:5]
    lineage["modules"].update({module: "0" * 64 for module in changed})  # built by older code
    folder = tmp_path / "checkpoint-old"
    folder.mkdir()
    write_lineage(folder, lineage)
    check = check_target_lineage(Target(None, None, "checkpoint", folder, False, _stale(folder, "grpo", project, {})))
    assert check.status == "warn" and check.detail.startswith(f"{folder} is stale")
    for module in changed:  # all of them, not the first few
        assert f"{module} changed since {folder} was built" in check.detail
    assert f"params seed: {old.seed} -> {project.seed}" in check.detail


def test_a_model_folder_without_lineage_is_skipped_unless_a_stage_under_it_is_stale(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    assert check_target_lineage(Target(None, None, "model", folder, True, [])).status == "skip"
    stale = ["models/base is stale: params seed: 1 -> 2"]
    check = check_target_lineage(Target(None, None, "model", folder, True, stale))
    assert check.status == "warn" and "models/base is stale" in check.detail


def test_the_targets_staleness_reaches_the_base_and_judges_a_grpo_adapter_by_its_own_inputs(tmp_path):
    """A current GRPO adapter is not stale (its lineage holds the grpo stage's inputs, not SFT's); a stale base
    under a current-looking SFT model is named when the SFT model is diagnosed."""
    from grpo import paths
    from grpo.checks.diagnosis_target import _sft_stale, load_target
    from grpo.provenance.lineage import make_lineage, write_lineage
    from tests.eval_project import add_grpo_adapter, build_project

    cfg = build_project(tmp_path)
    add_grpo_adapter(cfg)
    assert load_target(cfg, paths.model_dir(cfg, "grpo")).stale == []
    assert _sft_stale(cfg) == []
    changed = cfg.model_copy(update={"seed": cfg.seed + 1})
    write_lineage(paths.model_dir(cfg, "base"), make_lineage("base", changed, paths.stage_inputs(changed, "base")))
    assert any("base" in line for line in _sft_stale(cfg))
