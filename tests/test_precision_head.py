"""grpo/model/precision.py: the head. Its logits are fp32 under bf16 autocast, with a backward at the body's
precision; on a CPU its product is fp32 and each row's own; on CUDA the split-bf16 product (its arithmetic
emulated on a CPU, its bound measured on CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.model.fast.head import ONEDNN_MIN_WEIGHTS, fp32_product, onednn_product
from grpo.model.precision import (
    Fp32Head,
    Fp32Product,
    SplitProduct,
    bf16_autocast,
    head_product,
    split_bf16,
    split_product,
    split_product_available,
)

CPU = torch.device("cpu")


def test_the_head_is_fp32_under_bf16_autocast_and_keeps_its_weights(tiny_model, tiny_tokenizer):
    """Fp32Head: the logits under bf16 autocast are the fp32 product of the (bf16-computed) hidden states
    and the fp32 weights, not a bf16-rounded one; the weights stay the tied embedding, the names unchanged."""
    head = tiny_model.get_output_embeddings()
    assert isinstance(head, Fp32Head) and head.weight is tiny_model.get_input_embeddings().weight
    assert "lm_head.weight" in tiny_model.state_dict()
    ids = torch.tensor([tiny_tokenizer.encode("Elbrook was founded in 1821 by Mara Venn. Who founded it?")])
    with bf16_autocast(CPU, bf16=True, force=True):
        out = tiny_model(input_ids=ids, output_hidden_states=True)
        bf16 = torch.nn.functional.linear(out.hidden_states[-1], head.weight)  # what a plain head gives
    exact = out.hidden_states[-1].double() @ head.weight.double().T
    assert float((out.logits.double() - exact).abs().max()) < 1e-5
    assert bf16.dtype == torch.bfloat16 and float((bf16.double() - exact).abs().max()) > 1e-4
    assert isinstance(copy.deepcopy(tiny_model).get_output_embeddings(), Fp32Head)


def test_the_heads_backward_runs_at_the_bodys_precision(tiny_model):
    """Fp32Head's backward: without autocast the fp32 product; under bf16 autocast the gradients of the
    hidden states and of a trainable head's weights are bf16 products of the fp32 logits' gradient (as
    every other layer's backward), the forward's fp32 logits bit for bit those of a plain fp32 head."""
    head = copy.deepcopy(tiny_model.get_output_embeddings())
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, head.in_features)
    grad = torch.randn(3, 5, head.out_features)

    def run(autocast: bool):
        x, weight = hidden.clone().requires_grad_(True), head.weight
        weight.grad = None
        with bf16_autocast(CPU, bf16=autocast, force=autocast):
            logits = head(x)
        logits.backward(grad)
        return logits, x.grad, weight.grad

    fp32_logits, fp32_hidden, fp32_weight = run(autocast=False)
    assert torch.allclose(fp32_hidden, grad @ head.weight.detach(), atol=1e-5)
    low_logits, low_hidden, low_weight = run(autocast=True)
    assert torch.equal(low_logits, fp32_logits) and low_logits.dtype == torch.float32
    g = grad.bfloat16()
    assert low_hidden.dtype == torch.float32
    assert torch.equal(low_hidden, (g @ head.weight.detach().bfloat16()).float())
    assert torch.equal(low_weight, (g.reshape(15, -1).T @ hidden.reshape(15, -1).bfloat16()).float())
    assert not torch.equal(low_hidden, fp32_hidden)
    assert torch.allclose(low_hidden, fp32_hidden, rtol=2e-2, atol=2e-2 * float(fp32_hidden.abs().max()))
    assert torch.allclose(low_weight, fp32_weight, rtol=2e-2, atol=2e-2 * float(fp32_weight.abs().max()))
    with torch.no_grad(), bf16_autocast(CPU, bf16=True, force=True):
        assert torch.equal(head(hidden), fp32_logits)
    biased = Fp32Head(head.in_features, head.out_features, bias=True)  # a head with a bias: its gradient
    with bf16_autocast(CPU, bf16=True, force=True):  # is the fp32 sum of the logits' gradient over positions
        biased(hidden).backward(grad)
    assert torch.allclose(biased.bias.grad, grad.sum(dim=(0, 1)), atol=1e-5)


def test_the_heads_backward_gives_each_input_that_needs_one_its_gradient(tiny_model):
    """A trainable head over hidden states that need no gradient (a frozen body) still gets its weights'
    gradient; a frozen head over trainable hidden states gets none."""
    head = copy.deepcopy(tiny_model.get_output_embeddings())
    torch.manual_seed(0)
    hidden, grad = torch.randn(3, 5, head.in_features), torch.randn(3, 5, head.out_features)
    expected = (grad.bfloat16().reshape(15, -1).T @ hidden.reshape(15, -1).bfloat16()).float()
    with bf16_autocast(CPU, bf16=True, force=True):
        logits = head(hidden)
    logits.backward(grad)
    assert torch.equal(head.weight.grad, expected)
    head.weight.grad = None
    head.weight.requires_grad_(False)
    x = hidden.clone().requires_grad_(True)
    with bf16_autocast(CPU, bf16=True, force=True):
        logits = head(x)
    logits.backward(grad)
    assert head.weight.grad is None and x.grad is not None


def _product(hidden, weight, bias):
    """The head's product as ``model.fast_paths: auto`` runs it: oneDNN's where ``onednn_product``."""
    return fp32_product(hidden, weight, bias, onednn_product(hidden, weight))


def test_the_cpu_heads_product_is_fp32_and_each_rows_own(monkeypatch):
    """``fast.fp32_product`` (the head's product; oneDNN's for a large head on a CPU): fp32 precision against a
    float64 product, not a bf16 rounding; a row's logits the same whichever other rows share its batch
    (2 or more), as the decode loop and the scorer batch them; with oneDNN off, ``F.linear`` itself; and
    without autocast the head's gradients those of a plain fp32 ``nn.Linear``. A small head (the embedded
    model's) is ``F.linear`` throughout."""
    torch.manual_seed(0)
    weight, bias = torch.randn(2048, 576) * 0.05, torch.randn(2048)  # SmolLM2's hidden width
    hidden = torch.randn(200, 576)
    assert weight.numel() >= ONEDNN_MIN_WEIGHTS
    assert onednn_product(hidden, weight) == torch.backends.mkldnn.is_available()
    logits = _product(hidden, weight, bias)
    exact = hidden.double() @ weight.double().T + bias.double()
    scale = float(exact.abs().max())
    assert logits.dtype == torch.float32 and float((logits.double() - exact).abs().max()) < 1e-6 * scale * 8
    rounded = torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert float((rounded.double() - exact).abs().max()) > 1e-3 * scale  # what the head must not be
    generator = torch.Generator().manual_seed(1)
    for rows in (2, 3, 8, 31, 32, 64, 150):
        pick = torch.randperm(200, generator=generator)[:rows]
        assert torch.equal(_product(hidden[pick], weight, bias), logits[pick]), rows
    stacked = hidden.view(8, 25, 576)
    assert torch.equal(_product(stacked, weight, bias), logits.view(8, 25, -1))
    with monkeypatch.context() as patched:
        patched.setattr(torch.backends.mkldnn, "enabled", False)
        assert not onednn_product(hidden, weight)
        assert torch.equal(_product(hidden, weight, bias), torch.nn.functional.linear(hidden, weight, bias))
    assert not onednn_product(hidden, weight[:1024])  # a small head: MKL's product

    head = Fp32Head(576, 2048, bias=True)
    plain = torch.nn.Linear(576, 2048, bias=True)
    plain.load_state_dict(head.state_dict())
    grad = torch.randn(8, 25, 2048)
    for layer in (head, plain):
        x = stacked.clone().requires_grad_(True)
        layer(x).backward(grad)
        layer.x_grad = x.grad
    assert torch.equal(head.x_grad, plain.x_grad)
    assert torch.equal(head.weight.grad, plain.weight.grad) and torch.equal(head.bias.grad, plain.bias.grad)
    # The head a model runs multiplies through ``fp32_product``, with and without grad (at this width its
    # bits differ from MKL's ``F.linear``, so a head that bypassed it would fail here).
    with torch.no_grad():
        assert torch.equal(head(stacked), _product(stacked, head.weight, head.bias))
    assert torch.equal(head(stacked), _product(stacked, head.weight, head.bias))


def test_the_split_bf16_product_keeps_about_16_bits_of_each_term():
    """``split_product``'s arithmetic, emulated on a CPU (fp32 products of the bf16 parts, which are exact):
    within 2^-14 of ``|h| |w|`` of the float64 product at every logit, where one bf16 product is not."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 576, generator=gen), 0.05 * torch.randn(2048, 576, generator=gen)
    hi, lo = split_bf16(hidden)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert bool(((hi.double() + lo.double() - hidden.double()).abs() <= 2**-16 * hidden.double().abs()).all())
    exact = hidden.double() @ weight.double().T
    scale = hidden.double().abs() @ weight.double().abs().T  # [n, V] sum of |h_k w_k|
    emulated = split_product(split_bf16(hidden), split_bf16(weight), lambda a, b: a.float() @ b.float())
    assert emulated.dtype == torch.float32
    assert bool(((emulated.double() - exact).abs() <= 2**-14 * scale).all())
    single = hidden.bfloat16().float() @ weight.bfloat16().float().T
    assert float(((single.double() - exact).abs() / scale).max()) > 2**-11  # a bf16 product is far coarser


def test_off_cuda_the_head_scores_with_the_fp32_product():
    weight = torch.randn(8, 4)
    assert not split_product_available(torch.device("cpu"))
    assert isinstance(head_product(weight, None, torch.bfloat16), Fp32Product)


def test_the_split_product_serves_bf16_autocast_only(monkeypatch):
    """Where it is available (CUDA), bf16x3 stands in for the fp32 product under bf16 autocast only: an fp32
    run scores with the fp32 product, as its sampler does."""
    from grpo.model import precision

    monkeypatch.setattr(precision, "split_product_available", lambda device: True)
    weight = torch.randn(8, 4)
    assert isinstance(head_product(weight, None, torch.bfloat16), precision.SplitProduct)
    assert isinstance(head_product(weight, None, torch.float32), Fp32Product)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_the_cuda_split_product_is_the_fp32_products_within_its_bound():
    """On CUDA the bf16x3 product's logits are within 2^-14 of ``|h| |w|`` of the float64 product and
    within 2^-13 of the fp32 product's (the fp32 path's)."""
    device = torch.device("cuda")
    assert split_product_available(device), "this PyTorch lacks torch.mm(bf16, bf16, out_dtype=float32)"
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(256, 2048, generator=gen, device=device)
    weight = 0.05 * torch.randn(32768, 2048, generator=gen, device=device)
    product = head_product(weight, None, torch.bfloat16)
    assert isinstance(product, SplitProduct)
    exact = hidden.double() @ weight.double().T
    scale = hidden.double().abs() @ weight.double().abs().T
    split = product.logits(hidden).double()
    assert bool(((split - exact).abs() <= 2**-14 * scale).all())
    fp32 = Fp32Product(weight, None, weight).logits(hidden).double()
    assert bool(((split - fp32).abs() <= 2**-13 * scale).all())


def test_the_split_product_adds_the_heads_bias(monkeypatch):
    """``SplitProduct.logits`` (CUDA's products emulated on a CPU, fp32 products of the bf16 parts, which are
    exact): the bf16x3 product plus the bias, within the product's 2^-14 of ``|h| |w|``."""
    from grpo.model import precision

    monkeypatch.setattr(precision, "_mm_fp32_out", lambda a, b: a.float() @ b.float())
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(16, 64, generator=gen), 0.05 * torch.randn(128, 64, generator=gen)
    bias = torch.randn(128, generator=gen)
    logits = SplitProduct(split_bf16(weight), bias).logits(hidden)
    exact = hidden.double() @ weight.double().T + bias.double()
    scale = hidden.double().abs() @ weight.double().abs().T
    assert logits.dtype == torch.float32
    assert bool(((logits.double() - exact).abs() <= 2**-14 * scale + 1e-6 * bias.double().abs()).all())
