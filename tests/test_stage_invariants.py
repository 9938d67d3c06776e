"""I1-I5 and I9 proven on the functions the stages call, not on helpers.

``sft.build_examples`` (the SFT stage's example builder), ``rollout.rollout_from_sequences`` (the
rollout's cut and mask), ``step.prepare_batch`` (the step's batch preparation) and
``train.policy.build_policy`` (where the reference comes from). Each is fed inputs built to expose its
bug class: prompts of very different widths, a stop token equal to pad in mid-row.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from grpo import paths
from grpo.config import config_from_dict
from grpo.core.batching import left_pad
from grpo.data.prepare import build_records
from grpo.data.prompts import example_messages
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.loading import save_model
from grpo.model.lora import adapter_disabled
from grpo.model.rollout import rollout_from_sequences
from grpo.model.sampling import EosSuppressor
from grpo.provenance.lineage import make_lineage, write_lineage
from grpo.train.causal_lm import build_examples
from grpo.train.policy import build_policy
from grpo.train.step import draw, prepare_batch
from tests.steps import make_step

CFG = config_from_dict({"grpo": {"group_size": 2, "sampling": {"max_new_tokens": 5}}})


@pytest.fixture(scope="module")
def records():
    cfg = config_from_dict({"data": {"n_train": 16, "n_eval": 4}})
    train = [r.model_dump(mode="json") for r in build_records(cfg)["train"]]
    return [r for r in train if r["task"] == "fairness"][:2] + [r for r in train if r["task"] == "hallucination"][:2]


def _prompts(tokenizer, records) -> list[list[int]]:
    return [render_prompt(tokenizer, example_messages(r)) for r in records]


# --------------------------------------------------------------------------- I1, I2: sft.build_examples


def test_i1_sft_stage_examples_start_with_the_rl_prompt_ids(tiny_tokenizer, records):
    examples = build_examples(records, tiny_tokenizer, 4096, {})
    for record, prompt, example in zip(records, _prompts(tiny_tokenizer, records), examples, strict=True):
        assert example.ids[: len(prompt)] == prompt, record["id"]
        assert not any(example.loss_mask[: len(prompt)]), record["id"]


def test_i2_sft_stage_examples_supervise_the_end_of_turn_token(tiny_tokenizer, records):
    eot = end_of_turn_ids(tiny_tokenizer)
    for record, example in zip(records, build_examples(records, tiny_tokenizer, 4096, {}), strict=True):
        supervised = [i for i, keep in zip(example.ids, example.loss_mask, strict=True) if keep]
        assert supervised[-1] in eot and example.ids[-1] == supervised[-1], record["id"]
        assert tiny_tokenizer.decode(supervised[:-1]).strip(), record["id"]


# --------------------------------------------------------------------------- I4, I5: the rollout's cut and mask


def _hand_rollout(tokenizer, prompts, rows):
    """``rollout_from_sequences`` on generate()-shaped sequences: left-padded prompts, then ``rows``."""
    prompt = left_pad(prompts, tokenizer.pad_token_id)
    sequences = torch.cat([prompt.input_ids, torch.tensor(rows)], dim=1)
    width = prompt.input_ids.shape[1]
    eos_ids = end_of_turn_ids(tokenizer)
    return rollout_from_sequences(tokenizer, prompt, sequences, eos_ids, EosSuppressor(width, eos_ids, 0), 1,
                                  CFG.grpo.sampling)


def test_i4_rollout_cuts_at_the_padded_prompt_width(tiny_tokenizer, records):
    """Prompts of very different widths: a per-row cut would hand the short row its own prompt's tail."""
    prompts = sorted(_prompts(tiny_tokenizer, records), key=len)
    prompts = [prompts[0], prompts[-1]]
    assert len(prompts[1]) - len(prompts[0]) >= 3
    word = prompts[0][-5]
    rows = [[word, word + 1, word + 2, word + 3], [word + 3, word + 2, word + 1, word]]
    rollout = _hand_rollout(tiny_tokenizer, prompts, rows)
    assert rollout.completion_ids.tolist() == rows


def test_i5_rollout_mask_runs_to_the_first_stop_when_pad_is_eos(tiny_tokenizer, records):
    """pad == <|eot_id|> here: the mask must hold the stop token itself and nothing after it."""
    eot = end_of_turn_ids(tiny_tokenizer)[0]
    assert tiny_tokenizer.pad_token_id in end_of_turn_ids(tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer, records)[:3]
    word = prompts[0][-5]
    rows = [[word, word, eot, eot, eot], [word, eot, eot, eot, eot], [word] * 5]
    rollout = _hand_rollout(tiny_tokenizer, prompts, rows)
    assert rollout.completion_mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1] * 5]
    assert rollout.lengths.tolist() == [3, 2, 5] and rollout.truncated.tolist() == [False, False, True]


def test_i5_rollout_mask_stops_at_the_first_stop_when_pad_is_not_a_stop(tiny_tokenizer, records):
    """A pad that is no stop token (Qwen's): the pad ids the decode loop writes after a row's stop token
    are not part of the completion, and neither is any token after the first stop."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = tokenizer.bos_token
    pad, eot = tokenizer.pad_token_id, end_of_turn_ids(tokenizer)[0]
    assert pad not in end_of_turn_ids(tokenizer)
    prompts = _prompts(tokenizer, records)[:3]
    word = prompts[0][-5]
    rows = [[word, eot, pad, pad, pad], [word, word, word, eot, pad], [word, eot, word, word, pad]]
    rollout = _hand_rollout(tokenizer, prompts, rows)
    assert rollout.completion_mask.int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert rollout.lengths.tolist() == [2, 4, 2]


# --------------------------------------------------------------------------- I3: step.prepare_batch


def test_i3_prepare_batch_scores_the_generated_ids(tiny_model, tiny_tokenizer, records):
    step = make_step(tiny_model, tiny_tokenizer)
    sampled = draw(step, records, seed=8)
    batch = prepare_batch(step, sampled)
    rollout = sampled.rollout
    width = rollout.prompt_ids.shape[1]
    assert torch.equal(batch.inputs.input_ids[:, width:].cpu(), rollout.completion_ids)
    assert torch.equal(batch.inputs.input_ids[:, :width].cpu(), rollout.prompt_ids)
    assert torch.equal(batch.completion_mask.cpu(), rollout.completion_mask)


# --------------------------------------------------------------------------- I9: train.policy.build_policy


def test_i9_build_policy_puts_the_adapter_on_the_sft_weights(tmp_path, tiny_model, tiny_tokenizer, records):
    """The reference (adapter off) of the trainer's policy is models/sft exactly, not models/base."""
    cfg = config_from_dict({"paths": {"data_dir": str(tmp_path / "data"), "models_dir": str(tmp_path / "models")},
                            "model": {"lora": {"r": 2, "alpha": 4}}})
    sft = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for param in sft.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    save_model(tiny_model, tiny_tokenizer, tmp_path / "models" / "base")
    save_model(sft, tiny_tokenizer, paths.model_dir(cfg, "sft"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for stage in ("base", "sft"):
        write_lineage(paths.model_dir(cfg, stage), make_lineage(stage, cfg, paths.stage_inputs(cfg, stage)))
    policy = build_policy(cfg, torch.device("cpu")).model
    ids = torch.tensor([_prompts(tiny_tokenizer, records)[0]])
    with torch.no_grad():
        for name, param in policy.named_parameters():  # a trained adapter: off must really mean off
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
        assert not torch.allclose(policy(input_ids=ids).logits, sft(input_ids=ids).logits)
    with torch.no_grad(), adapter_disabled(policy):  # how score_reference turns the adapter off
        reference = policy(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(reference, sft(input_ids=ids).logits)
        assert not torch.allclose(reference, tiny_model(input_ids=ids).logits)


# --------------------------------------------------------------------------- I10 in part: what is sampled but not scored


def test_i10_rollout_lists_the_processors_that_shape_sampling_but_not_scoring():
    from grpo.checks.invariants import check_sampling_processors
    from grpo.model.rollout import sampling_processors

    plain = config_from_dict({"grpo": {"sampling": {"min_new_tokens": 0}}})
    shaped = config_from_dict({"grpo": {"sampling": {"top_p": 0.9, "top_k": 20, "presence_penalty": 0.5}}})
    assert sampling_processors(plain.grpo.sampling) == ()
    assert sampling_processors(CFG.grpo.sampling) == ("min_new_tokens=1",)  # the default suppresses EOS at step 0
    assert sampling_processors(shaped.grpo.sampling) == (
        "top_p=0.9", "top_k=20", "min_new_tokens=1", "presence_penalty=0.5")

    class Configured:  # the check reads the config only
        def __init__(self, cfg):
            self.cfg = cfg

    assert check_sampling_processors(Configured(plain)).status == "pass"
    warned = check_sampling_processors(Configured(shaped))
    assert warned.status == "warn" and warned.passed and "top_p=0.9" in warned.detail
