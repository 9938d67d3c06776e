"""The mutation table: each bug class of docs/invariants.md written as small patches of the code a stage
runs, several ways per class: in the function the class is about, in the SFT loop, in the rollout's
construction sites, in the trainer's wiring of the step.

``tests/test_mutations.py`` applies each patch to a copy of the project and asserts that the named tests
fail and that ``grpo preflight`` fails with the named check, or (``check`` None: a patch of the trainer's
own wiring, which the gate cannot run) that the passing report of the unpatched code goes stale, so
``grpo train`` refuses to start. A mutation that survives is a missing test or check. docs/invariants.md
lists the same rows.
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
    check: str | None  # the pre-flight check that must fail; None: the patch makes the gate's report stale
    retrain_sft: bool = False  # the patch is in the SFT stage: rebuild models/sft before the pre-flight
    # (the decode loop and its fast paths are in the SFT stage's code: the base stage pretrains through it)


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
        "    retok = [(step.tokenizer.encode(t, add_special_tokens=False) + [step.tokenizer.pad_token_id] * width)[:width]\n"
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
        "        direction = direction + grads.regulariser\n",
        "        direction = direction - grads.regulariser\n",
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
        "untempered_logprobs", "I10", "grpo/core/head_scores.py",
        "    log_probs = (raw / temperature).log_softmax(-1)  # [n, V] softmax(z / T), the sampling distribution (I10)\n",
        "    log_probs = raw.log_softmax(-1)\n",
        ("tests/test_logprobs.py::test_i10_logprobs_and_entropy_use_temperature_scaled_distribution",),
        "temperature", retrain_sft=True,  # the head scores in SFT's loss too: the base and SFT rebuild
    ),
    Mutation(
        "untempered_entropy", "I10", "grpo/core/head_scores.py",
        "    entropy = -(probs * log_probs).sum(-1) if with_entropy else None  # [n]\n",
        "    entropy = -(raw.softmax(-1) * raw.log_softmax(-1)).sum(-1) if with_entropy else None\n",
        ("tests/test_logprobs.py::test_i10_logprobs_and_entropy_use_temperature_scaled_distribution",),
        "temperature", retrain_sft=True,  # the head scores in SFT's loss too: the base and SFT rebuild
    ),
    Mutation(
        "zero_variance_divided_by_epsilon", "I12", "grpo/core/advantages.py",
        "    advantages = torch.where(zero_std.unsqueeze(-1), torch.zeros_like(centred), centred).reshape(-1)\n",
        "    advantages = centred.reshape(-1)\n",
        ("tests/test_advantages.py::test_i12_zero_variance_groups_give_zero_advantage_and_are_counted",),
        "zero_variance_groups",
    ),
    # ------------------------------------------------------------------ other ways to write the same bugs
    Mutation(
        "sft_conversation_without_the_system_turn", "I1", "grpo/train/causal_lm.py",
        "    return render_sft(tokenizer, example_messages(record), sft_target(record), **template_kwargs)\n",
        "    return render_sft(tokenizer, example_messages(record)[1:], sft_target(record), **template_kwargs)\n",
        ("tests/test_stage_invariants.py::test_i1_sft_stage_examples_start_with_the_rl_prompt_ids",),
        "render_parity", retrain_sft=True,
    ),
    Mutation(
        "sft_loss_drops_the_stop_position", "I2", "grpo/train/causal_lm.py",
        "    mask = batch.loss_mask[:, 1:]  # [B, T-1] bool\n",
        "    mask = batch.loss_mask[:, 1:].clone()  # [B, T-1] bool\n    mask[:, -1] = False\n",
        ("tests/test_causal_lm.py::test_i2_the_loss_reaches_every_stop_token",),
        "sft_supervises_stop", retrain_sft=True,
    ),
    Mutation(
        "sft_loop_drops_the_stop_from_each_example", "I2", "grpo/train/causal_lm.py",
        "            loss, stats = batch_loss(model, [examples[i] for i in rows], pad_id, accelerator.device, cfg.bf16)\n",
        "            unstopped = [SftExample(examples[i].ids, [*examples[i].loss_mask[:-1], False]) for i in rows]\n"
        "            loss, stats = batch_loss(model, unstopped, pad_id, accelerator.device, cfg.bf16)\n",
        ("tests/test_causal_lm.py::test_i2_training_supervises_every_stop_token",),
        "sft_ends_answers", retrain_sft=True,
    ),
    Mutation(
        "rollout_reencodes_its_completions", "I3", "grpo/model/rollout.py",
        "    completion_ids = completion_ids_from_generated(sequences.cpu(), prompt.input_ids.shape[1])\n",
        "    completion_ids = completion_ids_from_generated(sequences.cpu(), prompt.input_ids.shape[1])\n"
        "    width = completion_ids.shape[1]\n"
        "    decoded = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)\n"
        "    completion_ids = torch.tensor([(tokenizer.encode(t, add_special_tokens=False)\n"
        "                                    + [tokenizer.pad_token_id] * width)[:width] for t in decoded])\n",
        ("tests/test_rollout.py::test_i3_the_rollout_keeps_the_generated_ids",),
        "left_padded_extraction",  # the I3 check: the rollout's ids are not the ids the decode loop drew
    ),
    Mutation(
        "reward_texts_cut_per_row", "I4", "grpo/model/rollout.py",
        "        texts=tokenizer.batch_decode(kept, skip_special_tokens=True),\n",
        "        texts=tokenizer.batch_decode([row[int(n):][: len(k)].tolist() for row, n, k in\n"
        "                                      zip(sequences.cpu(), prompt.attention_mask.sum(1), kept, strict=True)],\n"
        "                                     skip_special_tokens=True),\n",
        ("tests/test_rollout.py::test_i4_the_reward_texts_are_the_completions_decoded",),
        "step_agreement",
    ),
    Mutation(
        "mask_keeps_tokens_after_the_first_stop", "I5", "grpo/model/rollout.py",
        "    masks = completion_mask(completion_ids, eos_ids)\n",
        "    masks = completion_mask(completion_ids, eos_ids)\n"
        "    masks = masks._replace(mask=masks.mask | ~torch.isin(completion_ids, torch.tensor(list(eos_ids))))\n",
        ("tests/test_stage_invariants.py::test_i5_rollout_mask_stops_at_the_first_stop_when_pad_is_not_a_stop",),
        "rollout_cut_and_mask",
    ),
    Mutation(
        "processors_built_with_the_first_prompts_width", "I6", "grpo/model/rollout.py",
        "    processors, suppressor = build_logits_processors(prompt_width, eos_ids, sampling)\n",
        "    processors, suppressor = build_logits_processors(len(prompts[0]), eos_ids, sampling)\n",
        ("tests/test_rollout.py::test_i6_processors_count_completion_tokens_of_a_short_first_prompt",),
        "processors_see_completion",
    ),
    Mutation(
        "entropy_sign_flipped_in_the_summed_backward", "I7", "grpo/train/update.py",
        "            task: total_loss(terms, loss_cfg.beta, loss_cfg.entropy_coef) for task, terms in by_task.items()\n",
        "            task: total_loss(terms, loss_cfg.beta, -loss_cfg.entropy_coef) for task, terms in by_task.items()\n",
        ("tests/test_update.py::test_i7_entropy_step_raises_entropy_in_every_mode",),
        "step_agreement",
    ),
    Mutation(
        "kl_from_the_sequence_log_ratio", "I8", "grpo/core/losses.py",
        "    delta = _masked(ref_logprobs - logprobs, completion_mask)\n",
        "    per_row = ((ref_logprobs - logprobs) * completion_mask).sum(-1, keepdim=True)\n"
        "    delta = _masked((per_row / completion_mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(logprobs),\n"
        "                    completion_mask)\n",
        ("tests/test_losses.py::test_i8_kl_is_the_per_token_k3_estimator",),
        "ratio_kl_reference", retrain_sft=True,  # SFT's masked loss is in losses.py too: models/sft goes stale
    ),
    Mutation(
        "the_steps_reference_is_the_base", "I9", "grpo/train/step.py",
        "        reference=policy.reference,\n",
        "        reference=__import__('grpo.model.stage_models', fromlist=['load_base']).load_base(cfg)[0]\n"
        "        .to(accelerator.device).eval(),\n",
        ("tests/test_trainer.py::test_i9_the_trainers_first_step_has_ratio_1_and_kl_0",),
        "first_step",
    ),
    Mutation(
        "the_trainer_swaps_in_the_base_as_reference", "I9", "grpo/train/trainer.py",
        "    policy = step.policy\n",
        "    step = __import__('dataclasses').replace(step, reference=__import__(\n"
        "        'grpo.model.stage_models', fromlist=['load_base']).load_base(cfg)[0].eval())\n"
        "    policy = step.policy\n",
        ("tests/test_trainer.py::test_i9_the_trainers_first_step_has_ratio_1_and_kl_0",),
        None,
    ),
    Mutation(
        "update_scores_at_temperature_one", "I10", "grpo/train/update.py",
        "            batch.inputs.rows(rows),\n",
        "            __import__('dataclasses').replace(batch.inputs.rows(rows), temperature=1.0),\n",
        ("tests/test_update.py::test_i10_the_update_scores_at_the_rollouts_temperature",),
        "step_agreement",
    ),
    Mutation(
        "reference_scored_at_temperature_one", "I10", "grpo/train/update.py",
        "                    inputs.rows(idx),\n                    step.reference,\n",
        "                    __import__('dataclasses').replace(inputs.rows(idx), temperature=1.0),\n"
        "                    step.reference,\n",
        ("tests/test_step_batch.py::test_i10_the_reference_is_scored_at_the_rollouts_temperature",),
        "step_agreement",
    ),
    Mutation(
        "attention_reaches_the_padding", "I11", "grpo/core/attention.py",
        "    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, K]\n",
        "    real = torch.ones_like(attention_mask, dtype=torch.bool)[:, None, None, :]  # [B, 1, 1, K]\n",
        ("tests/test_logprobs.py::test_i11_logprobs_alone_equal_inside_padded_batch",),
        "left_padded_extraction", retrain_sft=True,
    ),
    Mutation(
        "zero_variance_read_on_scaled_rewards", "I12", "grpo/core/advantages.py",
        "    zero_std = grouped.amax(dim=-1) == grouped.amin(dim=-1)  # [n_groups], exact equality\n",
        "    zero_std = centred.abs().amax(dim=-1) == 0  # [n_groups]\n",
        ("tests/test_advantages.py::test_i12_zero_variance_groups_give_zero_advantage_and_are_counted",),
        "zero_variance_groups",
    ),
    # ------------------------------------------------------------------ the sampler against the scorer (issue 53)
    Mutation(
        "kept_prefill_mapped_to_prompts_by_the_permutation", "I10", "grpo/core/prefix.py",
        "    order = torch.argsort(index).repeat_interleave(repeats)\n",
        "    order = index.repeat_interleave(repeats)\n",
        ("tests/test_agreement.py::test_the_sampler_and_the_scorer_agree_on_a_correct_step",),
        "fast_paths", retrain_sft=True,
    ),
    Mutation(
        "decode_writes_pad_over_a_drawn_stop", "I3", "grpo/model/fast/decode.py",
        "        tokens = torch.where(running, tokens, pad_id)  # [N]\n"
        "        sequences = torch.cat([sequences, tokens[:, None]], dim=1)\n"
        "        running &= ~torch.isin(tokens, stops)\n",
        "        running &= ~torch.isin(tokens, stops)\n"
        "        tokens = torch.where(running, tokens, pad_id)  # [N]\n"
        "        sequences = torch.cat([sequences, tokens[:, None]], dim=1)\n",
        ("tests/test_decode.py::test_decode_keeps_a_drawn_stop_when_pad_is_another_token",),
        "step_agreement", retrain_sft=True,
    ),
    Mutation(
        "generate_samples_at_the_squared_temperature", "I10", "grpo/model/generation.py",
        "        temperature=None if greedy else sampling.temperature,\n",
        "        temperature=None if greedy else sampling.temperature**2,\n",
        ("tests/test_decode.py::test_decode_samples_generates_tokens",),
        "fast_paths", retrain_sft=True,  # the probes sample at T = 0.7 against the step's decode loop
    ),
    Mutation(
        "rollout_decodes_at_the_squared_temperature", "I10", "grpo/model/rollout.py",
        "            sampling,\n            eos_ids,\n            tokenizer.pad_token_id,\n",
        "            sampling.model_copy(update={'temperature': sampling.temperature**2}),\n"
        "            eos_ids,\n            tokenizer.pad_token_id,\n",
        ("tests/test_agreement.py::test_the_sampler_and_the_scorer_agree_on_a_correct_step",),
        "step_agreement",
    ),
    Mutation(
        "evaluation_samples_start_from_the_greedy_pass_last_columns", "I10", "grpo/model/fast/prompt_pass.py",
        "            [(k[..., :-1, :], v[..., :-1, :]) for k, v in self.layers], config=model.config\n",
        "            [(k[..., 1:, :], v[..., 1:, :]) for k, v in self.layers], config=model.config\n",
        ("tests/test_fast_paths_check.py::test_the_fast_paths_give_the_library_paths_tokens",),
        "fast_paths", retrain_sft=True,
    ),
    Mutation(
        "evaluation_samples_tile_the_greedy_pass_rows", "I10", "grpo/model/fast/prompt_pass.py",
        "        cache.batch_repeat_interleave(repeats)\n        return cache\n",
        "        cache.reorder_cache(torch.arange(n * repeats, device=prompt_ids.device) % n)\n        return cache\n",
        ("tests/test_fast_paths_check.py::test_the_fast_paths_give_the_library_paths_tokens",),
        "fast_paths", retrain_sft=True,
    ),
    Mutation(
        "zero_variance_read_from_the_group_std", "I12", "grpo/core/advantages.py",
        "    zero_std = grouped.amax(dim=-1) == grouped.amin(dim=-1)  # [n_groups], exact equality\n",
        "    zero_std = group_std == 0  # [n_groups]\n",
        ("tests/test_advantages.py::test_i12_equal_rewards_are_found_by_equality_not_by_their_std",),
        "zero_variance_groups",  # a batch of one group of equal rewards: its computed std is not 0
    ),
)
