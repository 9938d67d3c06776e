"""The mutation table: each DESIGN.md bug class written as a small patch of the code a stage runs.

``tests/test_mutations.py`` applies each patch to a copy of the project and asserts that both the
named tests and ``grpo preflight`` (the named check) fail. A mutation that survives is a missing
test. The README's invariant table lists the same rows.
"""

from __future__ import annotations

from typing import NamedTuple


class Mutation(NamedTuple):
    name: str
    invariant: str
    path: str  # file patched, relative to the project root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    check: str  # the pre-flight check that must fail
    retrain_sft: bool = False  # the patch is in the SFT stage: rebuild models/sft before the pre-flight


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "sft_joins_text_by_hand", "I1", "grpo/train/causal_lm.py",
        "    return render_sft(tokenizer, example_messages(record), sft_target(record), **template_kwargs)\n",
        "    text = example_messages(record)[-1]['content'] + '\\n\\n' + sft_target(record)\n"
        "    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]\n"
        "    return SftExample(ids, [False] * 3 + [True] * (len(ids) - 3))\n",
        ("tests/test_stage_invariants.py::test_i1_sft_stage_examples_start_with_the_rl_prompt_ids",),
        "render_parity", retrain_sft=True,
    ),
    Mutation(
        "sft_target_loses_end_of_turn", "I2", "grpo/train/causal_lm.py",
        "    return render_sft(tokenizer, example_messages(record), sft_target(record), **template_kwargs)\n",
        "    example = render_sft(tokenizer, example_messages(record), sft_target(record), **template_kwargs)\n"
        "    return SftExample(example.ids[:-1], example.loss_mask[:-1])\n",
        ("tests/test_stage_invariants.py::test_i2_sft_stage_examples_supervise_the_end_of_turn_token",),
        "render_parity", retrain_sft=True,
    ),
    Mutation(
        "step_retokenises_decoded_text", "I3", "grpo/train/step.py",
        "    inputs = rollout_inputs(rollout, device)\n",
        "    width = rollout.completion_ids.shape[1]\n"
        "    retok = [(ctx.tokenizer.encode(t, add_special_tokens=False) + [ctx.tokenizer.pad_token_id] * width)[:width]\n"
        "             for t in rollout.texts]\n"
        "    rollout = __import__('dataclasses').replace(rollout, completion_ids=torch.tensor(retok))\n"
        "    inputs = rollout_inputs(rollout, device)\n",
        ("tests/test_stage_invariants.py::test_i3_prepare_batch_scores_the_generated_ids",),
        "left_padded_extraction",
    ),
    Mutation(
        "rollout_cuts_per_row", "I4", "grpo/model/rollout.py",
        "    completion_ids = completion_ids_from_generated(sequences.cpu(), prompt.input_ids.shape[1])\n",
        "    width = sequences.shape[1] - prompt.input_ids.shape[1]\n"
        "    completion_ids = torch.stack([row[int(n) : int(n) + width] for row, n in\n"
        "                                  zip(sequences.cpu(), prompt.attention_mask.sum(1), strict=True)])\n",
        ("tests/test_stage_invariants.py::test_i4_rollout_cuts_at_the_padded_prompt_width",),
        "rollout_cut_and_mask",
    ),
    Mutation(
        "rollout_mask_is_not_pad", "I5", "grpo/model/rollout.py",
        "    masks = completion_mask(completion_ids, eos_ids)\n",
        "    masks = completion_mask(completion_ids, eos_ids)\n"
        "    masks = masks._replace(mask=completion_ids != tokenizer.pad_token_id)\n",
        ("tests/test_stage_invariants.py::test_i5_rollout_mask_runs_to_the_first_stop_when_pad_is_eos",),
        "rollout_cut_and_mask",
    ),
    Mutation(
        "penalty_counts_the_prompt", "I6", "grpo/model/sampling.py",
        '        completion = _completion(input_ids, self.prompt_width, "CompletionPenalty")  # [B, t]\n',
        "        completion = input_ids\n",
        ("tests/test_sampling.py::test_i6_prompt_only_repeated_words_do_not_change_first_step_logits_of_the_processor",),
        "penalty_scope",
    ),
    Mutation(
        "entropy_sign_flipped_in_reward_only", "I7", "grpo/core/multitask.py",
        "        direction = direction + regulariser\n",
        "        direction = direction - regulariser\n",
        ("tests/test_update.py::test_i7_entropy_step_raises_entropy_in_every_mode",),
        "entropy_sign",
    ),
    Mutation(
        "sequence_mean_ratio", "I8", "grpo/core/losses.py",
        "    log_ratio = _masked(logprobs - old_logprobs, completion_mask)  # [N, C], 0 where masked out\n",
        "    delta = _masked(logprobs - old_logprobs, completion_mask)\n"
        "    per_row = delta.sum(-1, keepdim=True) / completion_mask.sum(-1, keepdim=True).clamp(min=1)\n"
        "    log_ratio = _masked(per_row.expand_as(delta), completion_mask)\n",
        ("tests/test_losses.py::test_i8_ratio_is_per_token",),
        "ratio_kl_reference", retrain_sft=True,  # SFT's masked loss is in losses.py too: models/sft goes stale
    ),
    Mutation(
        "reference_is_the_base", "I9", "grpo/train/policy.py",
        "    model, tokenizer = load_sft(cfg)\n",
        "    from grpo.model.stage_models import load_base\n"
        "    model, tokenizer = load_base(cfg)[0], load_sft(cfg)[1]\n",
        ("tests/test_stage_invariants.py::test_i9_build_policy_puts_the_adapter_on_the_sft_weights",),
        "ratio_kl_reference",
    ),
    Mutation(
        "untempered_logprobs", "I10", "grpo/core/logprobs.py",
        "    logits = raw / temperature  # [B, C, V], the sampling distribution (I10)\n",
        "    logits = raw\n",
        ("tests/test_logprobs.py::test_i10_logprobs_and_entropy_use_temperature_scaled_distribution",),
        "temperature",
    ),
    Mutation(
        "untempered_entropy", "I10", "grpo/core/logprobs.py",
        "    entropy = entropy_from_logits(logits, chunk_size)  # [B, C]\n",
        "    entropy = entropy_from_logits(raw, chunk_size)\n",
        ("tests/test_logprobs.py::test_i10_logprobs_and_entropy_use_temperature_scaled_distribution",),
        "temperature",
    ),
    Mutation(
        "zero_variance_divided_by_epsilon", "I12", "grpo/core/advantages.py",
        "    advantages = torch.where(zero_std.unsqueeze(-1), torch.zeros_like(centred), centred).reshape(-1)\n",
        "    advantages = centred.reshape(-1)\n",
        ("tests/test_advantages.py::test_i12_zero_variance_groups_give_zero_advantage_and_are_counted",),
        "zero_variance_groups",
    ),
)
