"""grpo/cli.py: one command per stage from the stage table, typed options, exit codes and messages."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from grpo.cli import COMMANDS, COMMON, build_parser, main, resolve
from grpo.provenance import stages

NON_STAGE = ("plot-entropy", "diagnose", "fingerprint", "status", "pipeline", "seeds", "bias")


@pytest.fixture
def params(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(f"seed: 1\npaths:\n  data_dir: {tmp_path / 'data'}\n", encoding="utf-8")
    return path


def test_every_stage_has_its_command_from_the_table_and_nothing_else_is_a_stage():
    for spec in stages.STAGES.values():
        assert COMMANDS[spec.command].entry == spec.entry
        assert COMMANDS[spec.command].help == spec.help and spec.help
    stage_commands = {spec.command for spec in stages.STAGES.values()}
    assert set(COMMANDS) == stage_commands | set(NON_STAGE)


def test_every_entry_resolves_to_a_function():
    for name, command in COMMANDS.items():
        assert callable(resolve(command.entry)), name


def test_every_entry_takes_its_commands_options_by_keyword():
    """``main`` calls ``entry(cfg, **options)``: each command's parsed options must bind to its entry's
    signature (a stage left with an ``args`` parameter would raise TypeError only when run)."""
    parser = build_parser()
    for name, command in COMMANDS.items():
        argv = {"diagnose": [name, "TARGET"], "bias": [name, "--bbq", "DIR"]}.get(name, [name])
        options = {k: v for k, v in vars(parser.parse_args(argv)).items() if k not in COMMON}
        inspect.signature(resolve(command.entry)).bind(object(), **options)


def test_grpo_seeds_runs_the_pipeline_per_seed_through_the_cli(tmp_path, monkeypatch, capsys):
    from grpo import seed_sweep as seeds

    ran = []
    monkeypatch.setattr(seeds.pipeline, "run", lambda cfg: ran.append(cfg.seed) or 3)
    params = tmp_path / "params.yaml"
    params.write_text(f"paths:\n  runs_dir: {tmp_path / 'runs'}\n", encoding="utf-8")
    assert main(["seeds", "--seeds", "5", "6", "--params", str(params)]) == 3
    assert ran == [5]  # the first seed's failure stops the others
    assert "seed 5 stopped with exit code 3" in capsys.readouterr().out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in COMMANDS)


def test_options_reach_the_stage_function_typed(params, monkeypatch):
    seen = {}

    def fake_run(cfg, max_steps=None, select=None):
        seen.update(cfg=cfg, max_steps=max_steps, select=select)
        return 0

    monkeypatch.setattr("grpo.train.trainer.run", fake_run)
    assert main(["train", "--params", str(params), "--max-steps", "3", "--set", "grpo.steps=9"]) == 0
    assert seen["max_steps"] == 3 and seen["cfg"].grpo.steps == 9 and seen["cfg"].seed == 1
    assert seen["select"] is None
    assert main(["train", "--params", str(params), "--select", "last"]) == 0
    assert seen["select"] == "last"
    assert main(["train", "--params", str(params), "--max-steps", "1"]) == 0 and seen["max_steps"] == 1


def test_a_stage_command_writes_its_stages_key_metrics(params, monkeypatch):
    """``grpo train`` is the ``grpo`` stage: its key metrics go to metrics/key/grpo/, where DVC reads them."""
    written = []
    monkeypatch.setattr("grpo.train.trainer.run", lambda cfg, max_steps=None, select=None: 0)
    monkeypatch.setattr("grpo.cli.write_key_metrics", lambda cfg, stage: written.append(stage))
    assert main(["train", "--params", str(params)]) == 0
    assert written == ["grpo"]


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        main([])
    assert done.value.code == 2 and "usage: grpo" in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_max_steps_below_one_is_refused_before_training(params, monkeypatch, capsys, steps):
    """``--max-steps 0`` once trained every step and ``-3`` none, exiting 0: both are usage errors."""
    monkeypatch.setattr("grpo.train.trainer.run", lambda cfg, max_steps=None, select=None: pytest.fail("trained"))
    with pytest.raises(SystemExit) as done:
        main(["train", "--params", str(params), "--max-steps", steps])
    assert done.value.code == 2
    assert f"{int(steps)} is not a step count: give 1 or more" in capsys.readouterr().err


def test_a_bad_params_value_exits_2_naming_key_value_and_fix(params, capsys):
    assert main(["prepare", "--params", str(params), "--set", "grpo.group_size=1"]) == 2
    err = capsys.readouterr().err
    assert "grpo.group_size" in err and "(got 1)" in err and err.startswith("error: ")


def test_a_library_error_exits_1_with_its_message(params, capsys):
    assert main(["evaluate", "--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "eval.jsonl: no eval split" in err and "grpo prepare" in err


def test_a_meaningless_flag_combination_exits_2_before_the_library_runs(params, capsys, monkeypatch):
    monkeypatch.setattr("grpo.eval.plots.run", lambda *a, **k: pytest.fail("the library ran"))
    assert main(["plot-entropy", "--params", str(params), "--labels", "x"]) == 2
    assert "--labels names --entropy-files" in capsys.readouterr().err


def test_fingerprint_command_writes_one_file_per_stage(params, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fingerprint", "--params", str(params)]) == 0
    assert sorted(p.stem for p in (tmp_path / "fingerprints").glob("*.json")) == sorted(stages.STAGES)
    assert "fingerprint: sft changed" in capsys.readouterr().out
