"""grpo/train/step.py: one GRPO step on the tiny model: accumulation before combination, NaN handling."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import pytest
import torch

from grpo.config import ModelConfig
from grpo.core.multitask import MultitaskError
from grpo.model.precision import apply_memory_settings, cpu_has_native_bf16
from grpo.train.step import draw, grpo_step, prepare_batch
from grpo.train.step_types import Step
from grpo.train.update import update
from tests.steps import (
    STAGE_CONTEXT,
    combined_gradient,
    make_step,
    stage_result,
    step_records,
    with_advantages,
)


@pytest.fixture(scope="module")
def records():
    return step_records()


def test_gradient_accumulation_happens_before_the_combination(tiny_model, tiny_tokenizer, records):
    """CAGrad is nonlinear: combining per-micro-batch gradients would differ from combining the
    accumulated ones. With per-task accumulation, grad_accum 1 and 3 give the same update."""
    whole = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "cagrad"})
    sampled = draw(whole, records, seed=11)
    # Advantages of both signs in every task, so both task gradients are non-zero and conflicting.
    signal = with_advantages(sampled, torch.linspace(-1, 1, len(sampled.rewards)))
    accum = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, multitask={"mode": "cagrad"}, grad_accum=3)
    g_whole = combined_gradient(whole, prepare_batch(whole, signal))
    g_accum = combined_gradient(accum, prepare_batch(accum, signal))
    assert g_whole.abs().max() > 0
    torch.testing.assert_close(g_accum, g_whole, rtol=1e-4, atol=1e-6)


def test_nan_in_the_loss_raises_and_updates_nothing(tiny_model, tiny_tokenizer, records):
    step = make_step(tiny_model, tiny_tokenizer)
    sampled = draw(step, records, seed=3)
    poisoned = with_advantages(sampled, torch.full_like(sampled.advantages, float("nan")))
    before = [p.detach().clone() for p in step.model.parameters()]
    with pytest.raises(MultitaskError, match="NaN/Inf"):
        update(step, prepare_batch(step, poisoned))
    assert all(torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))
    assert not step.optimizer.state, "the optimizer took a step"


@pytest.mark.parametrize("mode", ["sum", "cagrad"])
def test_a_nan_loss_stops_the_step_with_its_number(tiny_model, tiny_tokenizer, records, monkeypatch, mode):
    """The whole step as the trainer runs it: a NaN loss (here NaN advantages) stops it before any
    update, and the error gives the step, so the operator knows which checkpoints predate it."""
    from grpo.train import step as step_module
    from grpo.train.update import NonFiniteError

    real = step_module.group_advantages

    def nan_advantages(*args, **kwargs):
        advantages, stats = real(*args, **kwargs)
        return torch.full_like(advantages, float("nan")), stats

    monkeypatch.setattr(step_module, "group_advantages", nan_advantages)
    step = make_step(tiny_model, tiny_tokenizer, multitask={"mode": mode})
    before = [p.detach().clone() for p in step.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"^grpo: step 7 stopped before its update: .*NaN/Inf.*nothing of "
                                             r"step 7 was applied or saved"):
        grpo_step(step, records, 7, lambda attempt: records)
    assert all(torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))


def test_zero_variance_step_makes_no_update(tiny_model, tiny_tokenizer, records):
    """All advantages 0, no KL or entropy term: the gradient is exactly 0 and Adam does not step
    (its momentum must not move the weights during a reward deadlock)."""
    step = make_step(tiny_model, tiny_tokenizer, loss={"beta": 0.0, "entropy_coef": 0.0})
    sampled = draw(step, records, seed=5)
    frozen = with_advantages(sampled, torch.zeros_like(sampled.advantages))
    metrics, _ = update(step, prepare_batch(step, frozen))
    assert metrics["grad_norm"] == 0.0 and not step.optimizer.state


@pytest.mark.parametrize("mode", ["none", "filter", "resample"])
def test_step_reports_every_health_metric(tiny_model, tiny_tokenizer, records, mode):
    from grpo.health.metrics import HEALTH_METRICS

    step = make_step(tiny_model, tiny_tokenizer, dynamic_sampling=mode, max_resample=1)
    result = grpo_step(step, records, 1, lambda attempt: records[::-1])
    assert set(HEALTH_METRICS) <= set(result.metrics)
    assert len(result.raw_texts) == len(result.prompt_texts)
    assert "<|start_header_id|>" in result.header_tokens
    if mode != "none":
        assert result.metrics["dynamic/draws"] >= 1


PLAIN = {"shared_prefix": False, "multitask": {"mode": "sum", "low_memory": False, "task_stats": True}}
FAST = {"shared_prefix": True, "multitask": {"mode": "sum", "low_memory": True, "task_stats": False}}


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("mode", "low_memory"), [("sum", True), ("cagrad", True), ("cagrad", False)])
def test_fast_path_gives_the_plain_paths_numbers(tiny_model, tiny_tokenizer, records, mode, low_memory, device):
    """Every speed lever (shared-prefix scoring of the reference and the policy, the rollout's prefill
    reused by the policy pass, one graph per task, sum mode at one backward) changes no number: loss,
    entropy, KL and gradients agree in fp32, on the CPU and on a GPU."""
    loss = {"beta": 0.04, "entropy_coef": 0.01}
    plain = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, device, loss=loss,
                         **{**PLAIN, "multitask": {**PLAIN["multitask"], "mode": mode}})
    fast = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, device, loss=loss,
                        **{**FAST, "multitask": {**FAST["multitask"], "mode": mode, "low_memory": low_memory}})
    assert {next(step.model.parameters()).device.type for step in (plain, fast)} == {device}
    with torch.no_grad():  # a trained adapter, so the policy differs from the reference
        for step in (plain, fast):
            for name, param in step.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator(param.device).manual_seed(1))
    advantages = torch.linspace(-1, 1, 2 * len(records))
    sampled = with_advantages(draw(plain, records, seed=11), advantages)
    kept = with_advantages(draw(fast, records, seed=11), advantages)
    assert torch.equal(kept.rollout.completion_ids, sampled.rollout.completion_ids)
    assert not sampled.prefills and len(kept.prefills) == 2  # the fast draw kept one prefill per task
    plain_batch, fast_batch = prepare_batch(plain, sampled), prepare_batch(fast, kept)
    torch.testing.assert_close(fast_batch.ref_logprobs, plain_batch.ref_logprobs, rtol=0, atol=1e-5)
    got, expected = update(fast, fast_batch)[0], update(plain, plain_batch)[0]
    for key in ("loss", "entropy", "kl", "loss/fairness", "loss/hallucination"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    plain_grads = torch.cat([p.grad.flatten() for p in plain.model.parameters() if p.requires_grad])
    fast_grads = torch.cat([p.grad.flatten() for p in fast.model.parameters() if p.requires_grad])
    assert plain_grads.abs().max() > 1e-3
    torch.testing.assert_close(fast_grads, plain_grads, rtol=0, atol=1e-5)


def test_gradient_checkpointing_step_recomputes_and_gives_the_same_numbers(tiny_model, tiny_tokenizer, records,
                                                                          monkeypatch):
    """``model.gradient_checkpointing`` with the default shared prefix: the step runs (checkpointed layers
    return no cache in train mode, so it scores whole sequences), its layers are recomputed, and loss,
    KL and gradients equal the step's without checkpointing."""
    import transformers.modeling_utils as checkpoint_module  # where gradient_checkpointing_enable finds it

    calls = []
    original = checkpoint_module.checkpoint  # bound when checkpointing is enabled: patched before
    monkeypatch.setattr(checkpoint_module, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    loss = {"beta": 0.04, "entropy_coef": 0.01}
    plain = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss=loss, **FAST)
    checkpointed_model = apply_memory_settings(copy.deepcopy(tiny_model), ModelConfig(gradient_checkpointing=True))
    checkpointed = make_step(checkpointed_model, tiny_tokenizer, loss=loss, **FAST)
    assert checkpointed.model.training and checkpointed.model.is_gradient_checkpointing
    with torch.no_grad():
        for step in (plain, checkpointed):
            for name, param in step.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    advantages = torch.linspace(-1, 1, 2 * len(records))
    expected_batch = prepare_batch(plain, with_advantages(draw(plain, records, seed=11), advantages))
    assert not calls  # the plain model checkpoints nothing
    drawn = draw(checkpointed, records, seed=11)
    assert not checkpointed.reuses_prefill and not drawn.prefills  # the update scores whole sequences
    got_batch = prepare_batch(checkpointed, with_advantages(drawn, advantages))
    got, expected = update(checkpointed, got_batch)[0], update(plain, expected_batch)[0]
    assert calls, "no layer was checkpointed"
    for key in ("loss", "entropy", "kl"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    grads = [torch.cat([p.grad.flatten() for p in step.model.parameters() if p.requires_grad])
             for step in (checkpointed, plain)]
    assert grads[1].abs().max() > 1e-3
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16: grpo.bf16 runs fp32 here")
def test_bf16_step_computes_in_bf16_and_keeps_fp32_weights_and_statistics(tiny_model, tiny_tokenizer, records):
    """``grpo.bf16`` on a bf16 CPU: the forward passes run in bf16 (generation included), the log-probs,
    entropy, losses and the update stay fp32 and close to the fp32 step's on the same completions."""
    fp32 = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss={"beta": 0.04})
    bf16 = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss={"beta": 0.04}, bf16=True)
    with bf16.autocast():  # the body's matmuls in bf16; the LM head stays fp32 (precision.Fp32Head)
        assert torch.is_autocast_enabled("cpu")
        assert bf16.model(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32
    with fp32.autocast():
        assert not torch.is_autocast_enabled("cpu")
    sampled = with_advantages(draw(fp32, records, seed=11), torch.linspace(-1, 1, 2 * len(records)))
    low, full = prepare_batch(bf16, replace(sampled, prefills=())), prepare_batch(fp32, sampled)  # fp32's prefill
    assert low.ref_logprobs.dtype == torch.float32
    gap = (low.ref_logprobs - full.ref_logprobs).abs()[low.completion_mask].max()
    assert 0 < gap < 5e-2  # bf16 was used, and is close
    got, expected = update(bf16, low)[0], update(fp32, full)[0]
    for key in ("loss", "entropy", "kl"):
        assert got[key] == pytest.approx(expected[key], abs=5e-2), key
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in bf16.model.parameters() if p.requires_grad)
    grads = [torch.cat([p.grad.flatten() for p in c.model.parameters() if p.requires_grad]) for c in (bf16, fp32)]
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16: grpo.bf16 runs fp32 here")
def test_bf16_step_holding_frozen_weights_in_bf16_is_the_same_step(tiny_model, tiny_tokenizer, records, monkeypatch):
    """The step holds the frozen linear weights in bf16 (``Step.frozen_bf16``): the same completions,
    metrics and updated LoRA weights, bit for bit, as autocast's per-call casts; fp32 weights after."""
    def run(held: bool):
        if not held:
            monkeypatch.setattr(Step, "frozen_bf16", lambda self: contextlib.nullcontext())
        step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer, loss={"beta": 0.04}, bf16=True)
        seen = []  # the dtype of a frozen projection's weight at each of its forwards during the step
        proj = step.model.base_model.model.model.layers[0].mlp.down_proj
        hook = proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        result = grpo_step(step, records, 1, lambda attempt: records)
        hook.remove()
        monkeypatch.undo()
        return result, step.model, set(seen)

    (held, held_model, held_seen), (plain, plain_model, plain_seen) = run(True), run(False)
    assert held_seen == {torch.bfloat16} and plain_seen == {torch.float32}, "the step itself holds them"
    assert held.raw_texts == plain.raw_texts
    for key in ("loss", "entropy", "kl", "grad_norm"):
        assert held.metrics[key] == plain.metrics[key], key
    weights = [dict(m.named_parameters()) for m in (held_model, plain_model)]
    assert all(p.dtype == torch.float32 for p in weights[0].values())
    assert all(torch.equal(p, weights[1][n]) for n, p in weights[0].items())


def test_step_reports_the_time_of_every_phase(tiny_model, tiny_tokenizer, records):
    """Each phase's seconds and share of the step, and the step's own seconds within the wall time around it."""
    import time

    step = make_step(tiny_model, tiny_tokenizer, loss={"beta": 0.04})
    started = time.perf_counter()
    metrics = grpo_step(step, records, 1, lambda attempt: records).metrics
    assert 0 < metrics["step_time"] <= time.perf_counter() - started
    for phase in ("generate", "reward", "reference", "update"):
        assert metrics[f"timing/{phase}"] > 0, phase
        assert metrics[f"timing/{phase}_share"] == pytest.approx(metrics[f"timing/{phase}"] / metrics["step_time"])
    assert sum(metrics[f"timing/{p}_share"] for p in ("generate", "reward", "reference", "update")) <= 1.0


def test_the_step_counts_its_rows_by_task_and_its_tokens_per_second(tiny_tokenizer, monkeypatch):
    """``step_result``'s counts, which weigh each process's means when the processes' metrics merge, are
    rows, not prompts; its throughput is generated tokens, stop tokens included, per second: one grounded
    prompt of four completions of 2, 3, 4 and 1 tokens, in a step of 1 s."""
    from grpo.train import step as step_module

    seen = {}

    def gather(accelerator, metrics, counts, raw_texts, prompt_texts):
        seen.update(counts)
        return metrics, list(raw_texts), list(prompt_texts)

    monkeypatch.setattr(step_module.collectives, "gather_step", gather)
    eot = tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    words = tiny_tokenizer.encode(" the tall one", add_special_tokens=False)
    result = stage_result(tiny_tokenizer, [eot], [words[:1] + [eot], words[:2] + [eot], words[:3] + [eot], [eot]])
    assert (seen["groups"], seen["rows"], seen["rows/hallucination"], seen["rows/fairness"]) == (1, 4, 4, 0)
    assert result.metrics["completions/mean_length"] == 2.5
    assert result.metrics["tokens_per_s"] == pytest.approx(10.0)


def test_the_step_measures_throughput_over_its_own_time_and_names_each_rows_user_message(tiny_tokenizer):
    """10 generated tokens in a step of 2 s: 5 tokens/s (not 20); each completion's prompt text is its
    record's user message, the last of its messages (not the system prompt)."""
    from grpo.data.prompts import example_messages

    eot = tiny_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    words = tiny_tokenizer.encode(" the tall one", add_special_tokens=False)
    result = stage_result(tiny_tokenizer, [eot], [words[:1] + [eot], words[:2] + [eot], words[:3] + [eot], [eot]],
                          elapsed=2.0)
    assert result.metrics["step_time"] == 2.0
    assert result.metrics["tokens_per_s"] == pytest.approx(5.0)
    assert len(result.prompt_texts) == 4
    assert all("Who was late?" in text for text in result.prompt_texts)
    record = {"task": "hallucination", "context": STAGE_CONTEXT, "question": "Who was late?", "answerable": True}
    messages = example_messages(record)
    assert len(messages) >= 2 and messages[0]["content"] != messages[-1]["content"]
    assert result.prompt_texts == [messages[-1]["content"]] * 4


def test_a_nan_reward_stops_the_step_naming_its_task(tiny_model, tiny_tokenizer, records, monkeypatch):
    """A reward function that returns NaN for one fairness row stops the step before its reference pass,
    naming the step and the task (the update's own NaN check would name neither the reward nor the task)."""
    from grpo.train import step as step_module
    from grpo.train.update import NonFiniteError

    real = step_module.group_rewards

    def one_nan(texts, records_, group, cfg):
        rewards = list(real(texts, records_, group, cfg))
        rewards[0] = float("nan")  # row 0 answers records[0], a fairness record
        return rewards

    monkeypatch.setattr(step_module, "group_rewards", one_nan)
    monkeypatch.setattr(step_module, "prepare_batch", lambda *a: pytest.fail("the step went on to score"))
    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
    with pytest.raises(NonFiniteError, match=r"NaN/Inf reward at step 3 for task\(s\) \['fairness'\]"):
        grpo_step(step, records, 3, lambda attempt: records)


def test_each_draw_reports_its_rewards_kind_by_kind(tiny_model, tiny_tokenizer, records):
    """The draw's statistics carry the reward and abstention of every kind of item it holds, so a trade
    between kinds shows in the step's metrics."""
    from grpo.data.kinds import record_kind
    from grpo.health.kinds import abstention_key, reward_key

    step = make_step(copy.deepcopy(tiny_model), tiny_tokenizer)
    sampled = draw(step, records, seed=4)
    kinds = {record_kind(r) for r in records}
    assert len(kinds) >= 2
    for kind in kinds:
        assert reward_key(kind) in sampled.stats and abstention_key(kind) in sampled.stats
