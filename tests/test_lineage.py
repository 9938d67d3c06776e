"""Lineage guard: an artifact built by other code, params or inputs is refused, naming the change."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from grpo.config import Config, config_from_dict
from grpo.errors import GrpoError
from grpo.provenance import stages
from grpo.provenance.lineage import (
    LINEAGE_FILE,
    MissingInputError,
    StaleArtifactError,
    check_lineage,
    dir_hash,
    is_stale,
    make_lineage,
    params_hash,
    params_values,
    write_lineage,
)
from grpo.provenance.stages import StageSpec


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A stage ``toy`` whose code is a temp package, with one data input and a built artifact."""
    code = tmp_path / "code"
    _write(code / "toypkg/__init__.py", "")
    _write(code / "toypkg/main.py", "from toypkg.helper import scale\n\ndef run():\n    return scale(2)\n")
    _write(code / "toypkg/helper.py", "def scale(x):\n    return x * 2\n")
    _write(code / "toypkg/unrelated.py", "Y = 1\n")
    spec = StageSpec("toy", "toy-cmd", ("toypkg.main",), ("seed", "model.tiny", "experiment", "paths"), ())
    monkeypatch.setattr(stages, "STAGES", {"toy": spec})
    inputs = {"train": _write(tmp_path / "data/train.jsonl", '{"q": 1}\n')}
    artifact = tmp_path / "models/toy"
    _write(artifact / "weights.bin", "w")
    write_lineage(artifact, make_lineage("toy", Config(), inputs, root=code))
    return {"code": code, "inputs": inputs, "artifact": artifact}


def _check(toy, cfg=None):
    check_lineage(toy["artifact"], "toy", cfg or Config(), toy["inputs"], root=toy["code"])


def test_fresh_lineage_passes(toy):
    _check(toy)
    assert is_stale(toy["artifact"], "toy", Config(), toy["inputs"], root=toy["code"]) is None


def test_lineage_file_records_code_params_and_inputs(toy):
    recorded = json.loads((toy["artifact"] / LINEAGE_FILE).read_text())
    assert recorded["stage"] == "toy"
    assert sorted(recorded["modules"]) == ["toypkg/__init__.py", "toypkg/helper.py", "toypkg/main.py"]
    assert recorded["params"] == {"seed": 1234, "model.tiny": Config().model.tiny.model_dump(mode="json")}
    assert recorded["inputs"] == {"train": dir_hash(toy["inputs"]["train"])}
    assert len(recorded["code_fingerprint"]) == 64 and recorded["created_at"]


def test_semantic_code_change_names_the_module(toy):
    _write(toy["code"] / "toypkg/helper.py", "def scale(x):\n    return x * 3\n")
    with pytest.raises(StaleArtifactError) as info:
        _check(toy)
    message = str(info.value)
    assert f"toypkg/helper.py changed since {toy['artifact']} was built" in message
    assert "toypkg/main.py" not in message
    assert "`dvc repro toy` (or `grpo toy-cmd`)" in message


def test_comment_or_docstring_change_is_not_stale(toy):
    _write(toy["code"] / "toypkg/helper.py", 'def scale(x):\n    """Doubles."""\n    return x * 2  # why\n')
    _check(toy)


def test_change_outside_the_closure_is_not_stale(toy):
    _write(toy["code"] / "toypkg/unrelated.py", "Y = 2\n")
    _check(toy)


def test_newly_imported_module_is_named(toy):
    _write(toy["code"] / "toypkg/main.py", "from toypkg.helper import scale\nfrom toypkg import unrelated\n")
    with pytest.raises(StaleArtifactError, match="toypkg/unrelated.py is now part of the stage's code"):
        _check(toy)


def test_changed_param_names_the_key_and_both_values(toy):
    cfg = config_from_dict({"seed": 7, "model": {"tiny": {"hidden_size": 64}}})
    with pytest.raises(StaleArtifactError) as info:
        _check(toy, cfg)
    message = str(info.value)
    assert "params seed: 1234 -> 7" in message
    assert "params model.tiny.hidden_size: 128 -> 64" in message
    assert "num_hidden_layers" not in message


def test_param_the_stage_does_not_read_is_not_stale(toy):
    _check(toy, config_from_dict({"model": {"dtype": "bfloat16"}, "grpo": {"group_size": 8}}))


def test_naming_params_are_not_lineage(toy):
    cfg = config_from_dict({"experiment": "renamed", "paths": {"models_dir": "elsewhere"}})
    assert params_hash(cfg, "toy") == params_hash(Config(), "toy")
    assert set(params_values(cfg, "toy")) == {"seed", "model.tiny"}
    _check(toy, cfg)


def test_checkpoint_settings_are_not_grpo_lineage():
    """How often GRPO saves its state and how many it keeps never change its weights: a new
    ``checkpoint.every`` must not make the run's checkpoints (or models/grpo) stale."""
    changed = config_from_dict({"checkpoint": {"every": 1, "keep_last": 5, "resume": False}})
    assert "checkpoint" in stages.get_stage("grpo").params  # DVC still reruns the stage, which resumes
    assert params_hash(changed, "grpo") == params_hash(Config(), "grpo")
    assert params_hash(config_from_dict({"grpo": {"lr": 1e-4}}), "grpo") != params_hash(Config(), "grpo")


def test_changed_input_names_the_input(toy):
    _write(toy["inputs"]["train"], '{"q": 2}\n')
    with pytest.raises(StaleArtifactError, match=r"input train \(.*train.jsonl\) changed since"):
        _check(toy)


def test_vanished_input_names_the_input(toy):
    toy["inputs"]["train"].unlink()
    with pytest.raises(StaleArtifactError, match=r"input train \(.*\) no longer exists"):
        _check(toy)


def test_an_input_the_lineage_never_recorded_is_named(toy, tmp_path):
    inputs = {**toy["inputs"], "eval": _write(tmp_path / "data/eval.jsonl", '{"q": 3}\n')}
    with pytest.raises(StaleArtifactError, match=r"input eval \(.*eval.jsonl\) was not recorded when"):
        check_lineage(toy["artifact"], "toy", Config(), inputs, root=toy["code"])


def test_a_param_the_lineage_never_recorded_is_named(toy):
    """A setting the stage reads now but did not when the artifact was built (a newer field) makes it stale."""
    path = toy["artifact"] / LINEAGE_FILE
    lineage = json.loads(path.read_text())
    del lineage["params"]["seed"]
    path.write_text(json.dumps(lineage))
    with pytest.raises(StaleArtifactError, match=r"params seed: .* -> 1234"):
        _check(toy)


def test_missing_lineage_raises(toy):
    (toy["artifact"] / LINEAGE_FILE).unlink()
    with pytest.raises(StaleArtifactError, match="has no readable lineage.json"):
        _check(toy)


def test_missing_artifact_raises(toy, tmp_path):
    with pytest.raises(StaleArtifactError, match="does not exist"):
        check_lineage(tmp_path / "nowhere", "toy", Config(), toy["inputs"], root=toy["code"])


def test_lineage_of_another_stage_is_refused(toy, monkeypatch):
    other = StageSpec("other", "other", ("toypkg.main",), ("seed", "model.tiny"), ())
    monkeypatch.setitem(stages.STAGES, "other", other)
    message = is_stale(toy["artifact"], "other", Config(), toy["inputs"], root=toy["code"])
    assert message is not None and "written by stage 'toy', not 'other'" in message


def test_stale_error_is_a_grpo_error():
    assert issubclass(StaleArtifactError, GrpoError) and issubclass(MissingInputError, GrpoError)


# --------------------------------------------------------------------------- hashes


def test_dir_hash_ignores_lineage_and_sees_content_and_names(tmp_path):
    folder = tmp_path / "model"
    _write(folder / "a.bin", "1")
    _write(folder / "sub/b.bin", "2")
    before = dir_hash(folder)
    _write(folder / LINEAGE_FILE, "{}")
    _write(folder / "sub" / LINEAGE_FILE, "{}")
    assert dir_hash(folder) == before
    _write(folder / "sub/b.bin", "3")
    assert dir_hash(folder) != before
    _write(folder / "sub/b.bin", "2")
    assert dir_hash(folder) == before
    (folder / "sub/b.bin").rename(folder / "sub/c.bin")
    assert dir_hash(folder) != before


def test_dir_hash_sees_an_aged_weight_file_edited_in_place_within_one_process(tmp_path):
    """The lineage checks of one stage remember the hashes of unchanged files (``file_memo.memo_by_stat``);
    a weight edited in place after an earlier check must still change the hash."""
    folder = tmp_path / "model"
    weights = _write(folder / "model.safetensors", "0123456789")
    hour_ago = time.time_ns() - 3600 * 1_000_000_000
    os.utime(weights, ns=(hour_ago, hour_ago))
    before = dir_hash(folder)
    assert dir_hash(folder) == before
    with weights.open("r+b") as handle:
        handle.seek(5)
        handle.write(b"X")
    assert dir_hash(folder) != before
    assert dir_hash(weights) != dir_hash(_write(tmp_path / "old", "0123456789"))


def test_dir_hash_of_a_file_and_of_nothing(tmp_path):
    one, two = _write(tmp_path / "x.txt", "same"), _write(tmp_path / "y.txt", "same")
    assert dir_hash(one) == dir_hash(two)
    with pytest.raises(MissingInputError, match="nope"):
        dir_hash(tmp_path / "nope")


def test_real_stage_params_hash_follows_only_its_keys():
    base = Config()
    assert params_hash(config_from_dict({"grpo": {"group_size": 8}}), "sft") == params_hash(base, "sft")
    assert params_hash(config_from_dict({"grpo": {"group_size": 8}}), "grpo") != params_hash(base, "grpo")
    assert params_hash(config_from_dict({"seed": 1}), "sft") != params_hash(base, "sft")
    assert params_hash(config_from_dict({"experiment": "x"}), "grpo") == params_hash(base, "grpo")


def test_dir_hash_sees_a_changed_config_or_tokenizer_file(tmp_path):
    """Only lineage.json is left out: a model's config.json and tokenizer.json are part of what it is."""
    folder = tmp_path / "model"
    _write(folder / "model.safetensors", "w")
    _write(folder / "config.json", '{"hidden_size": 128}')
    _write(folder / "tokenizer.json", '{"eos": 1}')
    before = dir_hash(folder)
    _write(folder / "config.json", '{"hidden_size": 64}')
    assert dir_hash(folder) != before
    _write(folder / "config.json", '{"hidden_size": 128}')
    assert dir_hash(folder) == before
    _write(folder / "tokenizer.json", '{"eos": 2}')
    assert dir_hash(folder) != before


def test_dir_hash_sees_a_file_moved_to_another_subfolder(tmp_path):
    """``checkpoint-2/model.safetensors`` is not ``checkpoint-4/model.safetensors``: the path counts, not the name."""
    folder = tmp_path / "run"
    _write(folder / "checkpoint-2/model.safetensors", "w")
    _write(folder / "checkpoint-4/other.bin", "o")
    before = dir_hash(folder)
    (folder / "checkpoint-2/model.safetensors").rename(folder / "checkpoint-4/model.safetensors")
    assert dir_hash(folder) != before


def test_a_param_the_lineage_never_recorded_is_named_even_when_its_value_is_none(toy, monkeypatch):
    """A newer field whose value is None (``model.name_or_path`` of the embedded model) was still not part of
    what built the artifact: absent and null are different records."""
    spec = StageSpec("toy", "toy-cmd", ("toypkg.main",), ("seed", "model.tiny", "model.name_or_path"), ())
    monkeypatch.setitem(stages.STAGES, "toy", spec)
    assert params_values(Config(), "toy")["model.name_or_path"] is None
    with pytest.raises(StaleArtifactError, match=r'params model.name_or_path: "<absent>" -> null'):
        _check(toy)


def test_an_input_that_is_no_longer_one_is_named(toy):
    """The stage now reads fewer inputs than built the artifact (a real model instead of the embedded one)."""
    message = is_stale(toy["artifact"], "toy", Config(), {}, root=toy["code"])
    assert message is not None and "input train was recorded but is no longer an input" in message


def test_a_corrupt_lineage_file_is_refused_as_unreadable(toy):
    """A lineage.json that is not JSON (a copy cut short, an editor's leftovers) is stale, not a crash."""
    (toy["artifact"] / LINEAGE_FILE).write_text('{"stage": "toy", "code_fin')
    with pytest.raises(StaleArtifactError, match="has no readable lineage.json"):
        _check(toy)


@pytest.mark.parametrize("text", ["[]", "null", '"toy"', "3"])
def test_a_lineage_file_that_is_json_but_not_an_object_is_refused_as_unreadable(toy, text):
    """Valid JSON of another shape (a list, null, a string) records no lineage: stale, not an AttributeError."""
    (toy["artifact"] / LINEAGE_FILE).write_text(text)
    with pytest.raises(StaleArtifactError, match="has no readable lineage.json"):
        _check(toy)


def test_params_hash_does_not_follow_the_order_the_stage_names_its_keys(toy, monkeypatch):
    before = params_hash(Config(), "toy")
    reordered = StageSpec("toy", "toy-cmd", ("toypkg.main",), ("paths", "model.tiny", "experiment", "seed"), ())
    monkeypatch.setattr(stages, "STAGES", {"toy": reordered})
    assert list(params_values(Config(), "toy")) == ["model.tiny", "seed"]
    assert params_hash(Config(), "toy") == before


def test_a_changed_code_fingerprint_is_stale_when_every_module_matches(toy):
    """A lineage whose module hashes all match but whose fingerprint does not (edited, or made by a
    fingerprint of other rules) is stale, and says so."""
    path = toy["artifact"] / LINEAGE_FILE
    lineage = json.loads(path.read_text())
    path.write_text(json.dumps({**lineage, "code_fingerprint": "0" * 64}))
    with pytest.raises(StaleArtifactError, match="the code fingerprint of stage toy changed since"):
        _check(toy)


def test_a_vanished_input_does_not_hide_a_change_in_the_next(toy, tmp_path):
    inputs = {"a_eval": _write(tmp_path / "data/eval.jsonl", '{"q": 3}\n'), **toy["inputs"]}
    write_lineage(toy["artifact"], make_lineage("toy", Config(), inputs, root=toy["code"]))
    inputs["a_eval"].unlink()
    _write(inputs["train"], '{"q": 2}\n')
    reason = is_stale(toy["artifact"], "toy", Config(), inputs, root=toy["code"])
    assert "input a_eval" in reason and "no longer exists" in reason
    assert "input train" in reason and "changed since" in reason
