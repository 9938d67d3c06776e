"""Tests of grpo/core/multitask.py: per-task gradients and their combinations (the step's update, and I7 in
every mode through it, are tests/test_update.py's)."""

from __future__ import annotations

import pytest
import torch

from grpo.core.batching import left_pad
from grpo.core.logprobs import score_completions
from grpo.core.losses import masked_mean, policy_loss_terms, total_loss
from grpo.core.multitask import (
    BatchGradients,
    MultitaskError,
    accumulate,
    batch_gradients,
    cagrad,
    combine,
    combine_task_gradients,
    pcgrad,
    task_gradient,
)

PROMPTS = (
    "Context: Two friends met at the station. Question: Who was late?",
    "Answer: A.",
    "The river town of Elbrook was founded by Mara Venn in 1821.",
    "Options: A. the tall one B. the short one C. Unknown",
)
TASK_ROWS = {"fairness": [0, 2], "hallucination": [1, 3]}  # disjoint rows of one batch
TASKS = ("fairness", "hallucination")
WIDTH = 5
TEMPERATURE = 1.0


def task_batch(tokenizer):
    """(input_ids [4, P+C], attention_mask [4, P+C], completion_mask [4, C]) left-padded; row 1 ends early."""
    prompt = left_pad([tokenizer.encode(text) for text in PROMPTS], tokenizer.pad_token_id)
    completion_mask = torch.arange(WIDTH).unsqueeze(0) < torch.tensor([5, 2, 4, 5]).unsqueeze(1)
    completions = torch.randint(10, len(tokenizer), (4, WIDTH), generator=torch.Generator().manual_seed(0))
    completions = torch.where(completion_mask, completions, tokenizer.pad_token_id)
    input_ids = torch.cat([prompt.input_ids, completions], dim=1)
    attention_mask = torch.cat([prompt.attention_mask, completion_mask.long()], dim=1)
    return input_ids, attention_mask, completion_mask


def make_compute_losses(model, batch, advantages, calls=None):
    """compute_losses(subset): one forward over the rows of ``subset``, LossTerms per task."""
    input_ids, attention_mask, completion_mask = batch

    def compute_losses(subset, micro=0):
        if calls is not None:
            calls.append(subset)
        rows = [row for task in subset for row in TASK_ROWS[task]]
        scored = score_completions(model, input_ids[rows], attention_mask[rows], WIDTH, TEMPERATURE)
        out, start = {}, 0
        for task in subset:
            part = slice(start, start + len(TASK_ROWS[task]))
            start = part.stop
            terms, _ = policy_loss_terms(
                scored.logprobs[part], scored.logprobs[part].detach(), None, advantages[rows][part],
                completion_mask[rows][part], scored.entropy[part],
                epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo", max_completion_length=WIDTH,
            )
            out[task] = terms
        return out

    return compute_losses


@torch.no_grad()
def mean_entropy(model, batch) -> float:
    input_ids, attention_mask, completion_mask = batch
    scored = score_completions(model, input_ids, attention_mask, WIDTH, TEMPERATURE)
    return float(masked_mean(scored.entropy, completion_mask))


def combined(model, batch, advantages, tasks=TASKS, **kwargs):
    """Each task's gradient (``task_gradient``) from one shared forward, then ``combine_task_gradients``."""
    options = {"mode": "cagrad", "c": 0.5, "rescale": 1, "reward_only": False, "beta": 0.0, "entropy_coef": 0.0}
    options.update(kwargs)
    params = list(model.parameters())
    losses = make_compute_losses(model, batch, advantages)(tasks)
    grads = {}
    for task in tasks:
        accumulate(grads, task, task_gradient(params, losses[task], options["beta"],
                                              options["entropy_coef"], options["reward_only"], retain=True))
    zeros = torch.cat([torch.zeros(p.numel()) for p in params])
    return combine_task_gradients(batch_gradients(grads, zeros, options["reward_only"]), TASKS, zeros,
                                  mode=options["mode"], c=options["c"], rescale=options["rescale"])


def reference_task_grads(model, batch, advantages, part: str, beta=0.0, entropy_coef=0.0) -> torch.Tensor:
    """[2, P] per-task gradients computed by hand from the same loss functions."""
    losses = make_compute_losses(model, batch, advantages)(TASKS)
    params = list(model.parameters())
    rows = []
    for task in TASKS:
        terms = losses[task]
        loss = {"whole": total_loss(terms, beta, entropy_coef), "policy": terms.policy}[part]
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        flat = [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params, strict=True)]
        rows.append(torch.cat(flat))
    return torch.stack(rows)


# --------------------------------------------------------------------------- pure combinations


def test_sum_returns_the_sum_and_reports_norms_and_cosine():
    grads = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    d, stats = combine(grads, "sum", names=("fairness", "hallucination"))
    assert torch.equal(d, torch.tensor([3.0, 4.0]))
    assert stats["grad_norm/fairness"] == 3.0 and stats["grad_norm/hallucination"] == 4.0
    assert stats["grad_cos"] == pytest.approx(0.0)
    _, stats = combine(torch.tensor([[1.0, 1.0], [-1.0, 0.0]]), "sum")
    assert stats["grad_cos"] == pytest.approx(-(2**-0.5))


def test_pcgrad_removes_the_conflicting_component():
    g1, g2 = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])  # g1.g2 = -1: conflict
    expected = (g1 - (-1.0 / 2.0) * g2) + (g2 - (-1.0 / 1.0) * g1)  # each projected on the other's normal plane
    d = pcgrad(torch.stack([g1, g2]))
    torch.testing.assert_close(d, expected)
    assert d @ g1 >= 0 and d @ g2 >= 0
    agreeing = torch.tensor([[1.0, 0.5], [0.5, 1.0]])  # no conflict: plain sum
    assert torch.equal(pcgrad(agreeing), agreeing.sum(0))


@pytest.mark.parametrize("c", [0.3, 0.5, 2.0])
def test_cagrad_rescalings_divide_by_one_plus_c_squared_and_by_one_plus_c(c):
    """``cagrad_rescale`` 1 divides the direction by 1 + c^2, 2 by 1 + c (the CAGrad authors' code), 0 not."""
    grads = torch.tensor([[1.0, 0.2, -0.5], [-0.8, 1.0, 0.3]])
    plain, _ = combine(grads, "cagrad", c=c, rescale=0)
    for rescale, divisor in ((1, 1 + c * c), (2, 1 + c)):
        torch.testing.assert_close(combine(grads, "cagrad", c=c, rescale=rescale)[0], plain / divisor)


def test_a_task_with_an_exactly_zero_gradient_takes_no_part():
    """A task with nothing to learn is left out of the combination (it would halve CAGrad's mean), reports a
    norm of 0, and with one task left the cosine is reported as 0, not as agreement."""
    g = torch.tensor([1.0, -2.0, 0.5])
    grads = BatchGradients({"fairness": g, "hallucination": torch.zeros(3)}, None)
    for mode in ("sum", "pcgrad", "cagrad"):
        direction, stats = combine_task_gradients(grads, ("fairness", "hallucination"), torch.zeros(3), mode=mode,
                                                  c=0.5, rescale=1)
        torch.testing.assert_close(direction, combine(g[None], mode, c=0.5, rescale=1)[0])
        assert stats["multitask/tasks_combined"] == 1.0 and stats["grad_norm/hallucination"] == 0.0
        assert stats["grad_cos"] == 0.0


@pytest.mark.parametrize("rescale", [0, 1, 2])
def test_cagrad_c0_equals_mean_gradient(rescale):
    grads = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    d, _ = cagrad(grads, c=0.0, rescale=rescale)
    torch.testing.assert_close(d, grads.mean(0), atol=1e-6, rtol=0)


def conflicting_pairs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        g1 = torch.randn(40, generator=gen)
        g2 = -torch.rand(1, generator=gen) * 2 * g1 + 0.5 * torch.randn(40, generator=gen)
        assert g1 @ g2 < 0
        yield torch.stack([g1, g2])


@pytest.mark.parametrize("c", [1.0, 2.0])
def test_cagrad_result_has_nonnegative_inner_product_with_conflicting_gradients(c):
    # For c >= 1 the ball around g0 holds d = 0, so the maximiser of min_i g_i.d has min_i g_i.d >= 0.
    for grads in conflicting_pairs(20):
        d, weights = cagrad(grads, c=c, rescale=1)
        assert ((grads @ d) >= -1e-5 * grads.norm(dim=1) * d.norm()).all()
        assert weights.min() >= 0 and weights.sum().item() == pytest.approx(1.0)


def test_cagrad_improves_the_worst_task_over_the_mean_and_solves_the_dual():
    for grads in conflicting_pairs(10, seed=1):
        d, weights = cagrad(grads, c=0.5, rescale=0)
        assert (grads @ d).min() >= (grads @ grads.mean(0)).min() - 1e-6
        # Brute force over the 1-D simplex of K = 2: the dual's minimiser.
        gram = (grads @ grads.T).double()
        t = torch.linspace(0, 1, 20_001, dtype=torch.float64)
        w = torch.stack([t, 1 - t], dim=1)
        b = torch.full((2,), 0.5, dtype=torch.float64)
        dual = w @ gram @ b + 0.5 * (b @ gram @ b).sqrt() * ((w @ gram) * w).sum(1).clamp(min=0).sqrt()
        assert weights.double().sub(w[dual.argmin()]).abs().max() < 1e-4


def test_cagrad_dual_solver_handles_three_tasks_and_zero_gradients():
    grads = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    grads[2] = -0.8 * grads[0] + 0.3 * grads[2]  # tasks 0 and 2 conflict
    d, weights = cagrad(grads, c=1.0, rescale=0)
    assert weights.shape == (3,) and weights.min() >= 0 and float(weights.sum()) == pytest.approx(1.0)
    assert (grads @ d).min() >= -1e-5  # c >= 1: no task is made worse, for K = 3 too
    d, _ = cagrad(torch.zeros(2, 5), c=0.5, rescale=1)
    assert torch.equal(d, torch.zeros(5))


def test_combine_rejects_unknown_mode_and_rescale():
    with pytest.raises(MultitaskError, match="mode"):
        combine(torch.ones(2, 3), "mgda")
    with pytest.raises(MultitaskError, match="cagrad_rescale"):
        combine(torch.ones(2, 3), "cagrad", rescale=3)


# --------------------------------------------------------------------------- per-task gradients


@pytest.mark.parametrize("mode", ["sum", "pcgrad", "cagrad"])
def test_whole_loss_gradients_are_combined(tiny_model, tiny_tokenizer, mode):
    batch, advantages = task_batch(tiny_tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = reference_task_grads(tiny_model, batch, advantages, "whole", entropy_coef=0.1)
    expected, _ = combine(grads, mode, c=0.5, rescale=1)
    direction, stats = combined(tiny_model, batch, advantages, mode=mode, entropy_coef=0.1)
    torch.testing.assert_close(direction, expected, atol=1e-5, rtol=1e-4)
    assert {"grad_norm/fairness", "grad_norm/hallucination", "grad_cos", "cagrad/weights"} <= set(stats)
    assert (len(stats["cagrad/weights"]) == 2) == (mode == "cagrad")  # empty outside CAGrad


def test_reward_only_combines_policy_gradients_and_adds_kl_entropy_unchanged(tiny_model, tiny_tokenizer):
    batch, advantages = task_batch(tiny_tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5])
    policy = reference_task_grads(tiny_model, batch, advantages, "policy")
    whole = reference_task_grads(tiny_model, batch, advantages, "whole", entropy_coef=0.3)
    expected = combine(policy, "cagrad", c=0.5, rescale=1)[0] + (whole - policy).sum(0)
    direction, _ = combined(tiny_model, batch, advantages, reward_only=True, entropy_coef=0.3)
    torch.testing.assert_close(direction, expected, atol=1e-5, rtol=1e-4)


def test_task_without_rows_is_skipped(tiny_model, tiny_tokenizer):
    batch, advantages = task_batch(tiny_tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = reference_task_grads(tiny_model, batch, advantages, "whole")
    direction, stats = combined(tiny_model, batch, advantages, tasks=("fairness",), rescale=0)
    assert stats["multitask/tasks_combined"] == 1.0 and stats["grad_norm/hallucination"] == 0.0
    torch.testing.assert_close(direction, 1.5 * grads[0], atol=1e-5, rtol=1e-4)  # (1 + c) g


@pytest.mark.parametrize("mode", ["sum", "cagrad"])
def test_nan_gradient_raises_naming_the_task(tiny_model, tiny_tokenizer, mode):
    batch, advantages = task_batch(tiny_tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5])
    advantages[TASK_ROWS["hallucination"][0]] = float("nan")
    with pytest.raises(MultitaskError, match="hallucination"):
        combined(tiny_model, batch, advantages, mode=mode)


def test_accumulated_micro_batches_sum_before_the_combination(tiny_model, tiny_tokenizer):
    """``accumulate`` sums a task's gradients (and its regulariser and loss) over micro-batches."""
    batch, advantages = task_batch(tiny_tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5])
    params = list(tiny_model.parameters())
    losses = make_compute_losses(tiny_model, batch, advantages)(TASKS)
    one = task_gradient(params, losses["fairness"], 0.04, 0.1, reward_only=True, retain=True)
    grads: dict = {}
    accumulate(grads, "fairness", one)
    accumulate(grads, "fairness", one)
    torch.testing.assert_close(grads["fairness"].combined, 2 * one.combined)
    torch.testing.assert_close(grads["fairness"].regulariser, 2 * one.regulariser)
    assert grads["fairness"].loss == pytest.approx(2 * one.loss)
