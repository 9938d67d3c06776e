"""grpo/model/loading.py: a broken weights file is named with what is wrong and what to do, never loaded
half (the loader alone says ``SafetensorError: incomplete metadata``) or filled with random values."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from grpo.cli import main
from grpo.config import ModelConfig, config_from_dict
from grpo.model import stage_models
from grpo.model.loading import ModelLoadError, load_model, save_model
from grpo.model.precision import Fp32Head, output_head
from tests.tiny_project import run_stages, tiny_params, write_params

WRITE_AGAIN = "write it again: rerun the stage that wrote it"


@pytest.fixture
def saved(tmp_path, tiny_model, tiny_tokenizer):
    """A tiny model folder as `save_model` writes it; returns its weights file."""
    save_model(tiny_model, tiny_tokenizer, tmp_path / "model")
    return tmp_path / "model" / "model.safetensors"


CUTS = {
    # how much of the file is left -> what the error says
    "4 bytes": (lambda size: 4, "cut short: 4 bytes, less than the 8 that give its header's length"),
    "in its header": (lambda size: 100, "cut short: its header should take"),
    "in half": (lambda size: size // 2, "cut short: its tensors end at byte"),
    "by one byte": (lambda size: size - 1, "(1 missing)"),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_truncated_safetensors_file_is_named_with_the_fix(saved, cut):
    keep, words = CUTS[cut]
    data = saved.read_bytes()
    saved.write_bytes(data[: keep(len(data))])
    with pytest.raises(ModelLoadError) as err:
        load_model(saved.parent, ModelConfig())
    message = str(err.value)
    assert message.startswith(f"{saved}: not a whole safetensors file, ") and words in message, message
    assert WRITE_AGAIN in message


def test_bytes_after_the_last_tensor_are_named_as_corrupt(saved):
    saved.write_bytes(saved.read_bytes() + b"\0" * 7)
    with pytest.raises(ModelLoadError, match=rf"^{saved}: not a whole safetensors file, corrupt: 7 bytes follow"):
        load_model(saved.parent, ModelConfig())


def test_a_weight_missing_from_the_file_is_an_error_not_random_values(saved, tiny_model):
    weights = {k: v.contiguous() for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, saved, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack 1 of the model's weights \(model.layers.1.mlp.down_proj.weight\)"
                                             r": they would start from random values"):
        load_model(saved.parent, ModelConfig())


def test_a_truncated_adapter_is_named_before_anything_loads(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "grpo"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{")
    cfg = config_from_dict({"paths": {"models_dir": str(tmp_path / "models")}})
    monkeypatch.setattr(stage_models, "check_grpo", lambda cfg: None)  # the lineage is not what is tested
    monkeypatch.setattr(stage_models, "load_sft", lambda cfg: pytest.fail("loaded the SFT model first"))
    with pytest.raises(ModelLoadError, match=rf"^{folder / 'adapter_model.safetensors'}: not a whole safetensors"):
        stage_models.load_grpo(cfg)


def test_a_stage_reading_a_truncated_model_exits_1_with_one_error_line(tmp_path, capsys):
    """`grpo sft` on a models/base whose weights were cut (a full disk): exit 1, like every input error
    found while a stage runs, one `error:` line naming the file, and no SFT model written."""
    params = write_params(tmp_path, tiny_params(tmp_path))
    run_stages(params, "prepare", "validate", "base")
    weights = tmp_path / "models" / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["sft", "--params", str(params)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {weights}: not a whole safetensors file, cut short")
    assert not (tmp_path / "models" / "sft").exists()


def test_pickled_weights_are_never_loaded(tmp_path, tiny_model):
    """A folder with ``pytorch_model.bin`` only: a pickle runs code as it loads, and carries no whole-file check."""
    tiny_model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert (tmp_path / "pickled" / "pytorch_model.bin").is_file()
    with pytest.raises(ModelLoadError, match=r"no file named model.safetensors .*safetensors weights"):
        load_model(tmp_path / "pickled", ModelConfig())


@pytest.mark.parametrize("setting", ["off", "auto"])
def test_the_loaded_head_follows_model_fast_paths(saved, setting):
    head = output_head(load_model(saved.parent, ModelConfig(fast_paths=setting)))
    assert isinstance(head, Fp32Head) and head.fast_paths.setting == setting


def test_weights_load_in_model_dtype_whatever_the_checkpoint_stores(tmp_path, tiny_model, tiny_tokenizer):
    """A bf16 checkpoint trains with the fp32 master weights params ask for (``model.dtype``), not the file's."""
    import torch

    save_model(tiny_model.to(torch.bfloat16), tiny_tokenizer, tmp_path / "bf16")
    loaded = load_model(tmp_path / "bf16", ModelConfig())
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(tmp_path / "bf16", ModelConfig(dtype="bfloat16")).parameters()} == {
        torch.bfloat16}


def test_a_cut_shard_of_a_sharded_checkpoint_is_named(tmp_path, tiny_model, tiny_tokenizer):
    folder = tmp_path / "sharded"
    tiny_model.save_pretrained(folder, max_shard_size="100KB")
    tiny_tokenizer.save_pretrained(folder)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    shards[1].write_bytes(shards[1].read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match=rf"^{shards[1]}: not a whole safetensors file"):
        load_model(folder, ModelConfig())


def test_remote_code_runs_only_when_params_allow_it(saved, monkeypatch):
    from grpo.model import loading

    asked = []

    def from_pretrained(source, **kwargs):
        asked.append(kwargs["trust_remote_code"])
        raise ValueError("stop here")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    for trust in (False, True):
        with pytest.raises(ModelLoadError):
            load_model(saved.parent, ModelConfig(trust_remote_code=trust))
    assert asked == [False, True]


def test_nothing_is_fetched_from_a_hub_unless_params_allow_it(saved, monkeypatch):
    """``model.allow_download`` false (the default): the model and the tokenizer are asked for local files
    only; true: the library may fetch them."""
    from grpo.model import loading

    asked = []

    def from_pretrained(source, **kwargs):
        asked.append(kwargs["local_files_only"])
        raise ValueError("stop here")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", from_pretrained)
    assert not ModelConfig().allow_download
    for allow in (False, True):
        for load in (load_model, loading.load_tokenizer):
            with pytest.raises(ModelLoadError):
                load(saved.parent, ModelConfig(allow_download=allow))
    assert asked == [True, True, False, False]


def test_a_pointer_folder_stands_for_the_model_it_names(tmp_path):
    """``models/base`` of an external model holds a pointer, not the weights: it resolves to the named path."""
    from grpo.model.loading import resolve, write_pointer

    (tmp_path / "base").mkdir()
    write_pointer(tmp_path / "base", "/models/smollm2")
    assert resolve(tmp_path / "base") == "/models/smollm2"
    assert resolve(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


def test_the_safetensors_check_measures_the_header_and_the_tensors_exactly(tmp_path):
    """A file of a header and no tensor is whole; a header length past the file's end is named as such."""
    import json

    from grpo.model.loading import safetensors_problem

    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(len(header).to_bytes(8, "little") + header)
    assert safetensors_problem(empty) is None
    save_file({}, tmp_path / "saved-empty.safetensors")
    assert safetensors_problem(tmp_path / "saved-empty.safetensors") is None
    claims = tmp_path / "claims.safetensors"
    claims.write_bytes((len(header) + 4).to_bytes(8, "little") + header)  # four bytes more than there are
    assert safetensors_problem(claims) == (
        f"cut short: its header should take {len(header) + 4} bytes, the file holds {len(header)} after the length")
