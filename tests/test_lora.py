"""grpo/model/lora.py: the adapter peft builds from ``model.lora`` (rank, scale alpha / r, targets); its dropout:
tests/test_policy.py."""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from grpo.config import LoraConfig
from grpo.model.lora import wrap_lora


def test_the_adapters_update_is_alpha_over_r_times_b_a(tiny_model):
    """r=2, alpha=8: each adapted layer adds 4 * B A x to its frozen product; only the LoRA weights train."""
    policy = wrap_lora(tiny_model, LoraConfig(r=2, alpha=8, target_modules=["v_proj"]))
    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    assert len(layers) == tiny_model.config.num_hidden_layers
    assert all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(0)
    layer = layers[0]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
    assert a.shape[0] == b.shape[1] == 2
    with torch.no_grad():
        b.copy_(torch.randn(b.shape, generator=gen))
        x = torch.randn(3, a.shape[1], generator=gen)
        delta = layer(x) - layer.base_layer(x)
        torch.testing.assert_close(delta, 4.0 * x @ a.T @ b.T, rtol=1e-5, atol=1e-5)
