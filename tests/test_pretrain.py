"""grpo/train/pretrain.py: the base stage's corpus (training split, noised as SFT) and its pretraining."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import config_from_dict
from grpo.data.prompts import sft_target
from grpo.data.synthetic_fairness import templates_for
from grpo.data.synthetic_grounded import NAME_PARTS
from grpo.errors import GrpoError
from grpo.train.pretrain import pretrain_examples, pretrain_records, pretraining_text, run, tokenizer_corpus

TINY = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _cfg(tmp_path, records: int, **data):
    return config_from_dict({
        "paths": {name: str(tmp_path / name) for name in ("data_dir", "models_dir", "metrics_dir")},
        "data": data, "model": {"tiny": TINY},
        # The plain-text corpus of the data's task mix, one epoch (params.yaml chat-renders fairness instead).
        "pretrain": {"records": records, "batch_size": 8, "lr": 0.02, "epochs": 1, "fairness_fraction": None,
                     "chat_tasks": [], "group_by_length": False},
    })


def test_corpus_is_generated_training_split_text_with_the_sft_noise(tmp_path):
    cfg = _cfg(tmp_path, 200, fairness_fraction=0.5, sft_noise=0.5)
    records = pretrain_records(cfg)
    fair = [r for r in records if r.task == "fairness"]
    hall = [r for r in records if r.task == "hallucination"]
    assert len(records) == 200 and len(fair) == 100 and len(hall) == 100
    assert {r.split for r in records} == {"train"}
    eval_templates = {f"fairness.{category}.{index}" for category, index, _ in templates_for("eval")}
    assert not eval_templates & {r.template_id for r in fair}, "eval's held-out scenes leaked into pretraining"
    eval_names = {f"{a}{'' if kind == 'town' else ' '}{b}"
                  for kind, (firsts, seconds) in NAME_PARTS["eval"].items() for a in firsts for b in seconds}
    assert not [r for r in hall if any(name in r.question for name in eval_names)], "eval entities leaked"
    ambiguous = [r for r in fair if r.context_condition == "ambig"]
    biased = [r for r in ambiguous if r.sft_label != r.label]
    assert len(biased) == round(0.5 * len(ambiguous)), "the corpus must carry SFT's noise, not clean answers"
    unanswerable = [r for r in hall if not r.answerable]
    assert sum(r.sft_answer != r.answer for r in unanswerable) == round(0.5 * len(unanswerable))


def test_pretrain_fairness_fraction_sets_the_corpus_mix_and_defaults_to_the_datas(tmp_path):
    def fair(cfg):
        return sum(r.task == "fairness" for r in pretrain_records(cfg))

    assert fair(_cfg(tmp_path, 40, fairness_fraction=0.75)) == 30
    mixed = config_from_dict({**_cfg(tmp_path, 40, fairness_fraction=0.75).model_dump(),
                              "pretrain": {"records": 40, "fairness_fraction": 0.3}})
    assert fair(mixed) == 12 and len(pretrain_records(mixed)) == 40
    grounded_only = config_from_dict({**mixed.model_dump(), "pretrain": {"records": 40, "fairness_fraction": 0.0}})
    assert fair(grounded_only) == 0  # 0 is a share, not "unset"
    answerable = _cfg(tmp_path, 40, fairness_fraction=0.5, answerable_fraction=0.75)
    grounded = [r for r in pretrain_records(answerable) if r.task == "hallucination"]
    assert sum(r.answerable for r in grounded) == 15, "data.answerable_fraction of the grounded records"


def test_corpus_differs_from_the_prepared_train_split_and_is_reproducible(tmp_path):
    from grpo.data.prepare import build_records

    cfg = _cfg(tmp_path, 40, n_train=40)
    ids = [r.id for r in pretrain_records(cfg)]
    assert ids == [r.id for r in pretrain_records(cfg)]
    assert len(set(ids) & {r.id for r in build_records(cfg)["train"]}) < len(ids) // 4


def test_examples_are_the_plain_record_text_with_the_loss_on_every_token(tmp_path, tiny_tokenizer):
    cfg = _cfg(tmp_path, 6)
    records = [r.model_dump() for r in pretrain_records(cfg)]
    examples = pretrain_examples(records, tiny_tokenizer, cfg)
    assert len(examples) == 6
    header = tiny_tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    for record, example in zip(records, examples, strict=True):
        assert all(example.loss_mask) and len(example.loss_mask) == len(example.ids)
        assert example.ids[0] == tiny_tokenizer.bos_token_id and example.ids[-1] == tiny_tokenizer.eos_token_id
        assert header not in example.ids, "pretraining text carries no chat template"
        text = tiny_tokenizer.decode(example.ids[1:-1])
        assert text == pretraining_text(record) and text.endswith("\n\n" + sft_target(record))
        assert text.startswith(f"Context: {record['context']}\nQuestion: {record['question']}\n")
        assert text.count("Question: ") == 1
        if record["task"] == "fairness":
            assert all(f"{letter}. {choice}" in text for letter, choice in zip("ABC", record["choices"], strict=True))


def test_chat_task_records_are_the_sft_conversation_with_the_loss_on_every_token(tmp_path, tiny_tokenizer):
    """``pretrain.chat_tasks``: those tasks' records are exactly the ids the SFT stage builds (its prompt
    is the one GRPO samples from), with the loss on every token; the other task stays plain text."""
    from grpo.data.prompts import example_messages
    from grpo.model.chat import render_prompt
    from grpo.train.causal_lm import build_examples

    cfg = config_from_dict({**_cfg(tmp_path, 8).model_dump(), "pretrain": {"records": 8, "chat_tasks": ["fairness"]}})
    records = [r.model_dump() for r in pretrain_records(cfg)]
    examples = pretrain_examples(records, tiny_tokenizer, cfg)
    assert {r["task"] for r in records} == {"fairness", "hallucination"}
    for record, example in zip(records, examples, strict=True):
        assert all(example.loss_mask) and len(example.loss_mask) == len(example.ids)
        if record["task"] == "fairness":
            (sft,) = build_examples([record], tiny_tokenizer, 512, cfg.model.chat_template_kwargs)
            assert example.ids == sft.ids
            prompt = render_prompt(tiny_tokenizer, example_messages(record))
            assert example.ids[: len(prompt)] == prompt
            assert tiny_tokenizer.decode(example.ids[len(prompt):-1]) == sft_target(record)
        else:
            assert tiny_tokenizer.decode(example.ids[1:-1]) == pretraining_text(record)


def test_the_tokenizer_learns_the_prompt_words_it_reads_in_every_record(tmp_path):
    """The base stage trains the embedded tokenizer on the training records as the model reads them
    (system prompt, user turn, answer): the prompt's fixed words, in every record, become whole tokens."""
    from grpo.data import prepare
    from grpo.data.prompts import FAIRNESS_INSTRUCTION, HALLUCINATION_INSTRUCTION, SYSTEM_PROMPT
    from grpo.model.loading import load_tokenizer

    cfg = _cfg(tmp_path, 0, n_train=40, n_eval=4)
    assert prepare.run(cfg) == 0
    corpus = list(tokenizer_corpus(cfg))
    assert corpus.count(SYSTEM_PROMPT) == 40
    assert sum(text.endswith(FAIRNESS_INSTRUCTION) for text in corpus) == 20
    assert sum(text.endswith(HALLUCINATION_INSTRUCTION) for text in corpus) == 20
    assert run(cfg) == 0
    tokenizer = load_tokenizer(tmp_path / "models_dir" / "base", cfg.model)
    for text in (SYSTEM_PROMPT, FAIRNESS_INSTRUCTION, HALLUCINATION_INSTRUCTION, "Context:", "Question:", "Options:"):
        pieces = tokenizer.encode(text, add_special_tokens=False)
        words_and_marks = re.findall(r"\w+|[^\w\s]", text)
        assert len(pieces) <= len(words_and_marks) + 1, (text, tokenizer.convert_ids_to_tokens(pieces))


def test_a_text_longer_than_the_model_is_an_error_that_names_the_key(tmp_path, tiny_tokenizer):
    cfg = config_from_dict({"model": {"tiny": {**TINY, "max_position_embeddings": 64}}, "pretrain": {"records": 4}})
    with pytest.raises(GrpoError, match=r"model.tiny.max_position_embeddings=64"):
        pretrain_examples([r.model_dump() for r in pretrain_records(cfg)], tiny_tokenizer, cfg)
    records = [r.model_dump() for r in pretrain_records(cfg)]
    longest = max(len(example.ids) for example in pretrain_examples(records, tiny_tokenizer, config_from_dict(
        {"model": {"tiny": TINY}, "pretrain": {"records": 4}})))
    exact = config_from_dict({"model": {"tiny": {**TINY, "max_position_embeddings": longest}}, "pretrain": {"records": 4}})
    assert len(pretrain_examples(records, tiny_tokenizer, exact)) == 4  # a record of exactly the limit fits


def test_base_stage_pretrains_the_embedded_model_only_when_asked(tmp_path):
    from grpo.data import prepare

    plain, trained = tmp_path / "plain", tmp_path / "trained"
    for root in (plain, trained):
        assert prepare.run(_cfg(root, 0, n_train=16, n_eval=4)) == 0
    assert run(_cfg(plain, 0, n_train=16, n_eval=4)) == 0
    assert json.loads((plain / "metrics_dir" / "pretrain.json").read_text()) == {"steps": 0}
    assert (plain / "models_dir" / "base" / "lineage.json").is_file()
    assert run(_cfg(trained, 48, n_train=16, n_eval=4)) == 0
    summary = json.loads((trained / "metrics_dir" / "pretrain.json").read_text())
    assert summary["steps"] == 6 and summary["examples"] == 48
    assert summary["tokens"] > summary["examples"] and 0 < summary["wall_time_s"] < 600
    assert summary["loss_final"] < summary["loss_first"] - 0.5, summary
    before = load_file(plain / "models_dir" / "base" / "model.safetensors")
    after = load_file(trained / "models_dir" / "base" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[key], after[key]) for key in before), "pretraining saved no new weights"


def test_the_adapter_settings_leave_the_base_stage_alone(tmp_path):
    """`model.lora` is GRPO's (and LoRA SFT's): the base stage builds the same weights and the same
    lineage under any adapter, so DVC and the lineage guard need not rebuild it (BASE_MODEL_KEYS)."""
    from grpo.data import prepare
    from grpo.provenance.lineage import read_lineage

    bases = []
    for name, lora in (("default", {}), ("other", {"r": 4, "alpha": 4, "target_modules": ["q_proj"]})):
        cfg = _cfg(tmp_path / name, 48, n_train=16, n_eval=4)
        cfg = config_from_dict({**cfg.model_dump(mode="json"), "model": {"tiny": TINY, "lora": lora}})
        assert prepare.run(cfg) == 0 and run(cfg) == 0
        bases.append(tmp_path / name / "models_dir" / "base")
    first, second = (load_file(base / "model.safetensors") for base in bases)
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
    lineages = [read_lineage(base) for base in bases]
    assert lineages[0]["params_hash"] == lineages[1]["params_hash"], (lineages[0]["params"], lineages[1]["params"])
    assert not any(key.startswith("model.lora") for key in lineages[0]["params"]), lineages[0]["params"]
    assert lineages[0]["params"]["model.tiny"]["vocab_size"] == TINY["vocab_size"]


def test_a_real_models_base_is_loaded_once_and_a_presets_is_made_from_its_tokenizer(tmp_path, tiny_tokenizer):
    """``grpo base`` on a local folder loads its weights then (a folder whose weights do not load fails there,
    writing no pointer, not later in SFT); a preset's base records its real tokenizer folder as its input."""
    from grpo.model.architectures import tokenizer_folder
    from grpo.model.base_model import base_inputs, build_base
    from grpo.model.loading import ModelLoadError

    folder = tmp_path / "model"
    tiny_tokenizer.save_pretrained(folder)  # a tokenizer, no weights
    cfg = config_from_dict({"model": {"name_or_path": str(folder)}})
    out = tmp_path / "models" / "base"
    with pytest.raises(ModelLoadError):
        build_base(cfg, out)
    assert not out.exists() or not any(out.iterdir())
    preset = config_from_dict({"model": {"architecture": "qwen2.5-0.5b", "tokenizers_dir": str(tmp_path)}})
    assert base_inputs(preset) == {"tokenizer": tokenizer_folder("qwen2.5-0.5b", preset.model)}
