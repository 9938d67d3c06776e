"""grpo/eval/keymetrics.py: each stage's full report becomes a handful of numbers, one small file each (fast)."""

from __future__ import annotations

import json

from grpo.config import config_from_dict
from grpo.eval.keymetrics import KEY_METRICS, key_metrics_path, read_key_metrics, write_key_metrics
from grpo.eval.metrics import KEY_ROWS


def _cfg(tmp_path):
    return config_from_dict({"paths": {"metrics_dir": str(tmp_path / "metrics"),
                                       "reports_dir": str(tmp_path / "reports")}})


def test_eval_rows_are_one_file_each_with_the_models_side_by_side(tmp_path):
    cfg = _cfg(tmp_path)
    full = {model: {"greedy": {**dict.fromkeys(KEY_ROWS, 0.25), "nested": {"deep": [1, 2, 3]}},
                    "sampled": dict.fromkeys(KEY_ROWS, 0.5)} for model in ("base", "sft", "grpo")}
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(full))
    out = write_key_metrics(cfg, "evaluate")
    assert out == key_metrics_path(cfg, "evaluate") == tmp_path / "metrics" / "key" / "evaluate"
    assert json.loads((out / "hallucination" / "over_abstention_rate.json").read_text()) == {
        "base": 0.25, "sft": 0.25, "grpo": 0.25}
    key = read_key_metrics(out)
    assert set(key) == set(KEY_ROWS) and all(set(row) == {"base", "sft", "grpo"} for row in key.values())
    (out / "stale.json").write_text('{"value": 1}')  # a number the report no longer has
    write_key_metrics(cfg, "evaluate")
    assert not (out / "stale.json").exists()


def test_every_stage_with_a_report_keeps_only_scalars(tmp_path):
    cfg = _cfg(tmp_path)
    reports = {
        "validate": {"success": True, "n_rows": 24, "n_rules": 74, "n_failed": 0, "rules": [{"rule": "x"}] * 74},
        "sft": {"loss_first": 5.7, "loss_final": 5.6, "token_accuracy_final": 0.0, "steps": 2, "examples": 16,
                "wall_time_s": 2.3},
        "preflight": {"passed": False, "checks": [{"name": "I1", "passed": True}, {"name": "I5", "passed": True},
                                                 {"name": "I7", "passed": False}],
                      "lineage": {"code_fingerprint": "abc"}},
        "grpo": {"reward": -1.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "entropy": 5.7, "kl": 0.0,
                 "steps": 2, "reward_first": -1.0, "process_weight_digests": ["f" * 64], "selected_step": 2,
                 "selection": {"rule": "worst_kind", "step": 2, "reason": "..."}},
    }
    for stage, report in reports.items():
        field, name, _ = KEY_METRICS[stage]
        folder = tmp_path / field.removesuffix("_dir")
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(json.dumps(report))
        key = read_key_metrics(write_key_metrics(cfg, stage))
        assert key and all(isinstance(v, int | float | bool) for v in key.values()), (stage, key)
    assert read_key_metrics(key_metrics_path(cfg, "preflight")) == {"passed": False, "checks": 3, "failed": 1}
    assert read_key_metrics(key_metrics_path(cfg, "validate")) == {"passed": True, "rows": 24, "rules": 74,
                                                                    "failed_rules": 0}
    assert json.loads((key_metrics_path(cfg, "grpo") / "reward.json").read_text()) == {"value": -1.0}
    assert write_key_metrics(cfg, "prepare") is None  # no report, no key file
    assert read_key_metrics(key_metrics_path(cfg, "grpo"))["selected_step"] == 2  # the step models/grpo holds


def test_eval_key_file_carries_each_verdict_as_a_short_string(tmp_path):
    cfg = _cfg(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"grpo": {"greedy": dict.fromkeys(KEY_ROWS, 0.5)}}))
    verdicts = {"greedy": {"fairness": {"verdict": "traded", "better": ["a"], "worse": ["b"], "summary": "s"},
                           "hallucination": {"verdict": "improved", "better": [], "worse": [], "summary": "s"}}}
    (tmp_path / "metrics" / "eval_compare.json").write_text(json.dumps({"verdicts": verdicts}))
    key = read_key_metrics(write_key_metrics(cfg, "evaluate"))
    assert key["verdict/greedy/fairness"] == "traded" and key["verdict/greedy/hallucination"] == "improved"
    assert key["fairness/accuracy_ambig"] == {"grpo": 0.5}


def test_a_failed_validation_reads_failed(tmp_path):
    cfg = _cfg(tmp_path)
    field, name, _ = KEY_METRICS["validate"]
    folder = tmp_path / field.removesuffix("_dir")
    folder.mkdir()
    (folder / name).write_text(json.dumps({"success": False, "n_rows": 24, "n_rules": 74, "n_failed": 2}))
    assert read_key_metrics(write_key_metrics(cfg, "validate")) == {"passed": False, "rows": 24, "rules": 74,
                                                                     "failed_rules": 2}


def test_grpo_key_rows_carry_the_collapse_signals(tmp_path):
    """``dvc metrics show`` is where a finished run is read first: the deadlock share and the entropy of
    the last step must be among its rows."""
    cfg = _cfg(tmp_path)
    (tmp_path / "metrics").mkdir()
    report = {"reward": 0.5, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "entropy": 0.004, "kl": 0.1}
    (tmp_path / "metrics" / "grpo.json").write_text(json.dumps(report))
    key = read_key_metrics(write_key_metrics(cfg, "grpo"))
    assert key["frac_reward_zero_std"] == 1.0 and key["entropy"] == 0.004 and key["reward_std"] == 0.0
