"""grpo/provenance/stages.py: the real stage table against the CLI, and what each stage's fingerprint and
params hold (its own code, never the bookkeeping modules; the config keys its code reads)."""

from __future__ import annotations

from pathlib import Path

from grpo.cli import COMMANDS
from grpo.config import GrpoConfig, ModelConfig, config_from_dict
from grpo.provenance import fingerprint, stages
from grpo.provenance.fingerprint import stage_fingerprint
from grpo.provenance.lineage import params_hash

ROOT = Path(fingerprint.__file__).resolve().parents[2]


def test_stage_table_matches_the_cli():
    for spec in stages.STAGES.values():
        assert COMMANDS[spec.command].entry == spec.entry == f"{spec.modules[0]}:run", spec.name


def test_upstream_stages_exist_and_come_earlier():
    order = list(stages.STAGES)
    for spec in stages.STAGES.values():
        for up in spec.upstream:
            assert order.index(up) < order.index(spec.name), (up, spec.name)


def test_every_real_stage_has_a_fingerprint_of_its_own_code():
    for name in stages.STAGES:
        fp = stage_fingerprint(name)
        assert fp["stage"] == name
        assert "grpo/config.py" not in fp["modules"], name  # values enter through the params hash
        assert len(fp["fingerprint"]) == 64
    assert "grpo/core/multitask.py" in stage_fingerprint("grpo")["modules"]
    assert "grpo/core/multitask.py" not in stage_fingerprint("sft")["modules"]
    # The gate's report goes stale when the trainer's wiring of the step changes, which no check runs.
    assert {"grpo/train/trainer.py", "grpo/train/policy.py"} <= set(stage_fingerprint("preflight")["modules"])
    # A change to the monitor or the step reruns training, never evaluation.
    for module in (
        "grpo/health/monitor.py",
        "grpo/train/step.py",
        "grpo/train/checkpoint.py",
        "grpo/checks/preflight.py",
    ):
        assert module not in stage_fingerprint("evaluate")["modules"], module
    assert "grpo/model/chat.py" in stage_fingerprint("sft")["modules"]


def test_base_reads_every_model_key_but_the_adapter_and_the_adapter_stages_read_it():
    base = stages.get_stage("base").params
    assert set(stages.BASE_MODEL_KEYS) == {f"model.{f}" for f in ModelConfig.model_fields} - {"model.lora"}
    assert set(stages.BASE_MODEL_KEYS) <= set(base) and "model" not in base
    for name in ("sft", "preflight", "grpo", "evaluate"):  # each applies or loads the adapter
        assert any(key in ("model", "model.lora") for key in stages.get_stage(name).params), name


def test_preflight_reads_every_grpo_key_the_step_uses_and_the_rewards():
    """The checks drive the step: every grpo field but the run's length, speed, prompt draw and checkpoint
    selection is a pre-flight param, so a new precision, scoring path or loss reruns (and re-gates) the checks."""
    params = stages.get_stage("preflight").params
    unread = {"steps", "lr", "warmup_steps", "prompts_per_step", "fairness_fraction", "kind_share", "selection"}
    assert set(stages.PREFLIGHT_GRPO_KEYS) == {
        f"grpo.{f}" for f in GrpoConfig.model_fields if f not in unread
    }
    assert set(stages.PREFLIGHT_GRPO_KEYS) <= set(params) and "rewards" in params
    for key in ("grpo.bf16", "grpo.shared_prefix", "grpo.loss", "rewards"):
        changed = {
            "grpo.bf16": {"grpo": {"bf16": True}},
            "grpo.shared_prefix": {"grpo": {"shared_prefix": False}},
            "grpo.loss": {"grpo": {"loss": {"beta": 0.5}}},
            "rewards": {"rewards": {"weights": {"hallucination": 0.5}}},
        }[key]
        assert params_hash(config_from_dict(changed), "preflight") != params_hash(
            config_from_dict({}), "preflight"
        ), key
    assert params_hash(config_from_dict({"grpo": {"steps": 7, "lr": 1e-4}}), "preflight") == params_hash(
        config_from_dict({}), "preflight"
    )


def test_bookkeeping_modules_are_in_no_stage_closure():
    bookkeeping = {f"{name.replace('.', '/')}.py" for name in stages.BOOKKEEPING_MODULES}
    assert bookkeeping == {
        "grpo/provenance/stages.py",
        "grpo/provenance/fingerprint.py",
        "grpo/provenance/lineage.py",
        "grpo/provenance/file_memo.py",
        "grpo/provenance/gate.py",
        "grpo/config.py",
    }
    for name in stages.STAGES:
        assert not bookkeeping & set(stage_fingerprint(name)["modules"]), name


def test_existing_real_entry_modules_are_in_their_closure():
    for spec in stages.STAGES.values():
        for module in spec.modules:
            path = fingerprint.module_file(module, ROOT)
            if path is not None:
                assert path.relative_to(ROOT).as_posix() in stage_fingerprint(spec.name)["modules"]


def test_no_stage_closure_holds_a_bookkeeping_module_as_a_file_or_a_package():
    """``grpo.config`` is a package (``grpo/config/*.py``): neither its ``__init__.py`` nor any of its
    modules is in a stage's code, whichever spelling a bookkeeping module has on disk."""
    for name in stages.STAGES:
        for module in stage_fingerprint(name)["modules"]:
            dotted = module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for excluded in stages.BOOKKEEPING_MODULES:
                assert dotted != excluded and not dotted.startswith(excluded + "."), (name, module)
