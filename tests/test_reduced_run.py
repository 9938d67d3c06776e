"""End-to-end on a reduced run: GRPO raises the held-out reward, and known GRPO bugs are caught.

On a prepared project (tiny model, data, SFT, a passing pre-flight):

- the reduced run trains and ``grpo evaluate`` finds GRPO's mean reward on the eval split's held-out
  items above SFT's, with a paired-bootstrap 95 % interval above 0 (flipping the advantages' sign
  in ``grpo/core/advantages.py`` makes GRPO end far below SFT and this test fail);
- the entropy term's sign flipped in the gradient path of the configured multitask mode (DESIGN.md
  I7, ``grpo.core.multitask``'s use of ``total_loss``): the pre-flight gate runs the configured mode's
  entropy step, fails ``entropy_sign`` (and ``step_agreement``) and ``grpo train`` refuses to start, so no run with the bug can
  end up with a model; the same project without the bug passes again;
- the reference equal to the pre-SFT base (I9): ``ratio_kl_reference`` fails and training refuses.
"""

from __future__ import annotations

import json

import pytest

from grpo.checks.preflight import report_path
from grpo.cli import main as grpo_main
from grpo.config import load_config
from grpo.core import multitask
from grpo.core.losses import LossTerms
from grpo.model.stage_models import load_base
from grpo.train import policy
from tests.tiny_project import prepared_project

pytestmark = pytest.mark.slow


def _entropy_sign_flipped(terms: LossTerms, beta: float, entropy_coef: float):
    return terms.policy + beta * terms.kl + entropy_coef * terms.entropy


def test_entropy_sign_flipped_in_the_configured_mode_is_caught_before_training(tmp_path, monkeypatch, capsys):
    params = prepared_project(tmp_path / "p")  # a passing pre-flight, as made
    cfg = load_config(params)
    monkeypatch.setattr(multitask, "total_loss", _entropy_sign_flipped)
    assert grpo_main(["preflight", "--params", str(params)]) == 1
    report = json.loads(report_path(cfg).read_text())
    # The behaviour check and the step written apart (its update climbs the entropy) both see it.
    assert [check["name"] for check in report["checks"] if not check["passed"]] == ["entropy_sign", "step_agreement"]
    capsys.readouterr()
    assert grpo_main(["train", "--params", str(params)]) == 1
    assert "pre-flight failed (entropy_sign, step_agreement)" in capsys.readouterr().err
    assert not (tmp_path / "p" / "models" / "grpo").exists()
    monkeypatch.undo()  # the same project without the bug passes again
    assert grpo_main(["preflight", "--params", str(params)]) == 0


# Enough held-out items and GRPO steps that the reward gain is not a coin flip.
LEARNS = {"data": {"n_train": 96, "n_eval": 64}, "sft": {"epochs": 16},
          "grpo": {"steps": 32, "prompts_per_step": 8, "group_size": 4, "lr": 0.005},
          "eval": {"samples_per_prompt": 4}}


def test_grpo_raises_the_mean_reward_on_held_out_items_over_sft(tmp_path):
    """The reduced run trains, then ``grpo evaluate`` scores SFT and GRPO on the eval split's items."""
    params = prepared_project(tmp_path / "p", **LEARNS)
    assert grpo_main(["train", "--params", str(params)]) == 0
    assert grpo_main(["evaluate", "--params", str(params)]) == 0
    metrics = tmp_path / "p" / "metrics"
    results = json.loads((metrics / "eval.json").read_text())
    sft, grpo = results["sft"]["sampled"]["reward"], results["grpo"]["sampled"]["reward"]
    assert grpo > sft + 0.05, f"held-out mean reward: GRPO {grpo:.3f} vs SFT {sft:.3f}"
    interval = json.loads((metrics / "eval_compare.json").read_text())["grpo_minus_sft"]["sampled"]["reward"]
    assert interval["low"] > 0, f"GRPO - SFT reward interval {interval} includes 0"


def test_reference_equal_to_the_base_is_caught_before_training(tmp_path, monkeypatch, capsys):
    """I9's bug: the policy (and so its adapter-off reference) built on the pre-SFT base weights."""
    params = prepared_project(tmp_path / "p")
    cfg = load_config(params)
    load_sft = policy.load_sft
    monkeypatch.setattr(policy, "load_sft", lambda c: (load_base(c)[0], load_sft(c)[1]))
    assert grpo_main(["preflight", "--params", str(params)]) == 1
    failed = [check["name"] for check in json.loads(report_path(cfg).read_text())["checks"] if not check["passed"]]
    assert "ratio_kl_reference" in failed
    capsys.readouterr()
    assert grpo_main(["train", "--params", str(params)]) == 1
    assert "pre-flight failed" in capsys.readouterr().err
    assert not (tmp_path / "p" / "models" / "grpo").exists()
