"""grpo/model/kernels.py: ``sdpa_grouped`` gives ``sdpa``'s logits and gradients without the K/V copy."""

from __future__ import annotations

import pytest
import torch

from grpo.config import config_from_dict
from grpo.core.attention import model_attention_mask
from grpo.core.batching import left_pad, position_ids_from_mask
from grpo.model import kernels
from grpo.model.kernels import GROUPED_SDPA, attention_backends, attention_kernel, sdpa_grouped_forward
from grpo.model.lora import wrap_lora
from tests.weights import fill_adapter, spread_weights


def _policy(model):
    gen = torch.Generator().manual_seed(0)
    policy = wrap_lora(spread_weights(model, gen), config_from_dict({"model": {"lora": {"r": 2, "alpha": 4}}}).model.lora)
    return fill_adapter(policy, gen).train()


def _logits_and_grads(policy, implementation, prepared):
    policy.config._attn_implementation = implementation
    gen = torch.Generator().manual_seed(1)
    batch = left_pad([torch.randint(5, 300, (n,), generator=gen).tolist() for n in (12, 5, 9)], 0)
    mask = model_attention_mask(policy, batch.attention_mask, 12) if prepared else batch.attention_mask
    policy.zero_grad(set_to_none=True)
    logits = policy(input_ids=batch.input_ids, attention_mask=mask,
                    position_ids=position_ids_from_mask(batch.attention_mask)).logits
    real = batch.attention_mask.bool()
    (logits[real] * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
    return logits[real].detach(), grads


@pytest.mark.parametrize("prepared", [False, True], ids=["2d-mask", "prepared-mask"])
def test_sdpa_grouped_gives_sdpas_logits_and_gradients(tiny_model, prepared):
    assert tiny_model.config.num_key_value_heads < tiny_model.config.num_attention_heads, "grouped heads"
    assert tiny_model.config._attn_implementation == GROUPED_SDPA, "the embedded model is built with it"
    policy = _policy(tiny_model)
    plain_logits, plain_grads = _logits_and_grads(policy, "sdpa", prepared)
    grouped_logits, grouped_grads = _logits_and_grads(policy, GROUPED_SDPA, prepared)
    torch.testing.assert_close(grouped_logits, plain_logits, rtol=0, atol=1e-6)
    scale = plain_grads.abs().max()
    assert scale > 1e-2
    # The backward sums each key/value head's gradient over its query heads in another order.
    assert (grouped_grads - plain_grads).abs().max() / scale < 1e-5


def test_sdpa_grouped_is_what_sdpa_loads_and_nothing_else_changes():
    assert attention_kernel("sdpa") == GROUPED_SDPA
    assert attention_kernel("eager") == "eager" and attention_kernel("flash_attention_2") == "flash_attention_2"


@pytest.mark.parametrize(("groups", "masked"), [(3, True), (1, True), (3, False)],
                         ids=["grouped-masked", "ungrouped-masked", "grouped-unmasked"])
def test_sdpa_grouped_attends_in_fp32_under_cpu_autocast(groups, masked):
    """Under CPU bf16 autocast the kernel gets fp32 queries, keys and values (the bf16 CPU flash backward
    is several times slower than fp32's) and returns bf16, as autocast's attention would; the
    gradients reach fp32 inputs in fp32. So also for a model without grouped heads and for a pass
    without a mask (causal), which go through ``sdpa`` itself."""
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    q = torch.randn(2, 6, 5, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 6 // groups, 5, 8, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    mask = causal if masked else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_grouped_forward(module, q, k, v, mask, scaling=0.5)
    args = (q.detach(), k.detach().float(), v.detach().float())
    expected = torch.nn.functional.scaled_dot_product_attention(
        *args, attn_mask=causal, scale=0.5, enable_gqa=groups > 1
    )
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out, expected.transpose(1, 2).bfloat16(), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = torch.nn.functional.scaled_dot_product_attention(
            *args, attn_mask=causal, scale=0.5, enable_gqa=groups > 1
        )
    assert not torch.equal(rounded.transpose(1, 2), out), "autocast's own attention rounds q and k to bf16"
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0


def _sdp_flags() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
            "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}


def test_cuda_attention_never_chooses_cudnn_and_other_devices_are_left_alone(monkeypatch):
    """On CUDA the kernel's attention may run flash, memory-efficient or math, not cuDNN (which plans per
    shape); the flags come back after the block; a CPU's attention, and ``CUDA_BACKENDS = None``, change
    nothing."""
    before = _sdp_flags()
    assert before["cudnn"], "PyTorch's default allows cuDNN: the rule is what turns it off"
    with attention_backends("cuda"):
        assert _sdp_flags() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _sdp_flags() == before
    with attention_backends("cpu"):
        assert _sdp_flags() == before
    monkeypatch.setattr(kernels, "CUDA_BACKENDS", None)
    with attention_backends("cuda"):
        assert _sdp_flags() == before


def test_the_kernel_attends_under_its_devices_backends(monkeypatch):
    """``sdpa_grouped_forward`` asks ``attention_backends`` for the device its queries are on, around the
    attention itself (both of its routes)."""
    seen: list[tuple[str, dict]] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(device_type):
        seen.append(("enter", device_type))
        return attention_backends(device_type)

    def sdpa(*args, **kwargs):
        seen.append(("sdpa", None))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(kernels, "attention_backends", recording)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    sdpa_grouped_forward(module, q, k, v, causal)  # grouped with a mask: the kernel's own call
    sdpa_grouped_forward(module, q, k, v, None)  # through the library's sdpa
    assert seen == [("enter", "cpu"), ("sdpa", None)] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_attention_runs_no_cudnn_kernel_and_matches_the_librarys_choice():
    """On a GPU, bf16 attention under the project's masks runs no cuDNN kernel and gives the library's
    default choice's output within bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q = torch.randn(4, 8, 37, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(4, 4, 37, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([37, 30, 12, 1], device="cuda")
    real = torch.arange(37, device="cuda")[None, :] >= (37 - lengths)[:, None]  # left padding
    mask = real[:, None, None, :] & torch.ones(37, 37, dtype=torch.bool, device="cuda").tril()[None, None]
    mask = mask | ~real[:, None, :, None]  # padded queries see every key, as the library's masks do
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out, _ = sdpa_grouped_forward(module, q, k, v, mask)
        torch.cuda.synchronize()
    assert not any("cudnn" in event.key.lower() for event in profile.key_averages())
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_a_mask_wider_than_the_keys_attends_over_its_first_columns_as_sdpa_does():
    """A prepared mask may hold more key columns than there are keys (a cache sized ahead): the kernel reads
    its first ``K`` columns, as the library's ``sdpa`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(2))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    wider = torch.cat([causal, torch.ones(2, 1, 5, 3, dtype=torch.bool)], dim=-1)  # 3 columns past the keys
    out, _ = sdpa_grouped_forward(module, q, k, v, wider)
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, wider)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out, sdpa_grouped_forward(module, q, k, v, causal)[0], rtol=0, atol=0)
