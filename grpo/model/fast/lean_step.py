"""``LeanStep``: one decode step of a Llama-family model (Llama, Qwen2) on a CPU, without the module machinery.

After the first token a decode step runs one query per row through every layer, and on a CPU a good part
of it went to calling things rather than computing them: per layer seven projections and, under a LoRA
adapter, eight more small products, each through its module's ``__call__``, PEFT's adapter bookkeeping
and autocast's cast of the same input again. This step computes the very operations of the model's
forward (``LlamaDecoderLayer.forward``, PEFT's LoRA ``Linear.forward``), in their order, on the same
shapes, dtypes and weights, so every kernel is the one the model's forward runs; what it leaves out is the
Python around them, and the input of the projections that share one is cast to autocast's dtype once
(the rounding autocast makes at each of them). The norms' arithmetic is ``LlamaRMSNorm.forward``'s; the
rotary embedding, the cache update, the attention function and the head are the model's own.

Projections are not stacked into one product: a bf16 product of other shapes may run another kernel,
which sums in another order (on the embedded model's 16-wide key projection a few elements round the
other way), so only the very shapes keep the very numbers.

The first lean step of a kind (``_VERDICTS``: the model's class, attention, the weights' dtypes, autocast,
the adapters' layout, the row count) also runs the model's own forward from the same cache and compares
the logits and the keys and values written, bit for bit (``decode._step_logits``); where anything differs,
that kind never runs lean in the process, with a warning (``FastPathWarning``). A guard against a model
this code does not describe (a transformers release whose layer computes otherwise), not against
rounding: the operations are the same.

Not lean (``LeanStep.build`` returns ``None``; the model's own forward runs): other architectures, weights
that are not plain CPU tensors (sharded), modules with forward hooks, LoRA variants (DoRA), several active
adapters, an active dropout, or a training-mode model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpo.model.fast.warning import fall_back

LEAN_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""Causal LMs whose decoder layer is Llama's: RMSNorm, attention with rotary q/k, SiLU gate/up/down MLP."""

_VERDICTS: dict[tuple, bool] = {}
"""Whether a kind of lean step gave the model's own numbers, by ``LeanStep.kind`` and row count."""


@dataclass(frozen=True)
class _Projection:
    """A linear layer as the step computes it: ``F.linear(x, weight, bias)``, plus under a LoRA adapter
    ``F.linear(F.linear(x, lora_a), lora_b) * scaling`` (PEFT's order)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor | None = None  # [r, in]
    lora_b: torch.Tensor | None = None  # [out, r]
    scaling: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_a is None:
            return out
        return out + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


def _projection(module: nn.Module) -> _Projection | None:
    """``module`` (an ``nn.Linear`` or PEFT's LoRA ``Linear``) as a ``_Projection``; ``None`` where the step
    cannot compute it as the module does."""
    if type(module) is nn.Linear:
        return _Projection(module.weight, module.bias)
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or type(module).__name__ != "Linear" or not hasattr(module, "lora_A"):
        return None
    if module.disable_adapters or module.merged:
        return _Projection(base.weight, base.bias)
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) != 1 or module.lora_variant or getattr(module, "cast_input_dtype_enabled", True) is False:
        return None
    (name,) = active
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and dropout.training and dropout.p > 0:
        return None
    a, b = module.lora_A[name], module.lora_B[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        return None
    if a.weight.dtype != base.weight.dtype and not torch.is_autocast_enabled("cpu"):
        return None  # PEFT casts the input to the adapter's dtype, and adds in the wider one
    return _Projection(base.weight, base.bias, a.weight, b.weight, module.scaling[name])


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, operation for operation."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


class LeanStep:
    """Built per decode from the model as it is (``build``); called as
    ``step(input_ids [N, 1], attention_mask, position_ids [N, 1], cache) -> logits [N, 1, V]``."""

    def __init__(self, causal_lm: nn.Module, layers: list[tuple[nn.Module, dict[str, _Projection]]]) -> None:
        self.causal_lm = causal_lm
        self.inner = causal_lm.model
        self.layers = layers
        self.low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        attn = self.inner.layers[0].self_attn
        self.attention = _attention_function(causal_lm)
        self.rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.head_dim = attn.head_dim
        self.kind = (
            type(causal_lm).__name__,
            causal_lm.config._attn_implementation,
            self.low,
            tuple(sorted({str(p.dtype) for p in causal_lm.parameters()})),
            tuple((key, p.bias is not None, p.lora_a is not None) for key, p in layers[0][1].items()),
        )

    @classmethod
    def build(cls, model: nn.Module) -> LeanStep | None:
        """The lean step of ``model`` (PEFT-wrapped or not), or ``None`` where the module docstring says."""
        causal_lm = _causal_lm(model)
        if causal_lm is None or model.training or _hooked(model):
            return None
        if any(type(p.data) is not torch.Tensor or p.device.type != "cpu" for p in model.parameters()):
            return None
        layers = []
        for layer in causal_lm.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
                return None
            modules = {
                "q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
                "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj,
            }
            projections = {key: _projection(module) for key, module in modules.items()}
            if any(p is None for p in projections.values()):
                return None
            layers.append((layer, projections))
        return cls(causal_lm, layers)

    def __call__(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """``model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=cache, use_cache=True,
        logits_to_keep=1).logits``, the layers' operations in their order."""
        rows, width = input_ids.shape
        hidden = self.inner.embed_tokens(input_ids)
        seen = cache.get_seq_length()
        cos, sin = self.inner.rotary_emb(hidden, position_ids)
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": torch.arange(seen, seen + width)}
        shape = (rows, width, -1, self.head_dim)
        for index, (layer, p) in enumerate(self.layers):
            attn = layer.self_attn
            residual = hidden
            x = self._operand(_rms_norm(layer.input_layernorm, hidden))
            q = p["q"](x).view(shape).transpose(1, 2)
            k = p["k"](x).view(shape).transpose(1, 2)
            v = p["v"](x).view(shape).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            k, v = cache.update(k, v, index, cache_kwargs)
            out, _ = self.attention(
                attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, position_ids=position_ids,
                use_cache=False,
            )
            hidden = residual + p["o"](self._operand(out.reshape(rows, width, -1).contiguous()))
            residual = hidden
            x = self._operand(_rms_norm(layer.post_attention_layernorm, hidden))
            hidden = residual + p["down"](self._operand(layer.mlp.act_fn(p["gate"](x)) * p["up"](x)))
        hidden = _rms_norm(self.inner.norm, hidden)
        return self.causal_lm.lm_head(hidden[:, -1:, :])

    def verdict(self, rows: int) -> bool | None:
        """Whether this kind of step at ``rows`` rows gave the model's own numbers; ``None`` where not yet
        checked (``decode`` checks the first one)."""
        return _VERDICTS.get((*self.kind, rows))

    def record(self, rows: int, same: bool) -> None:
        """Keep the verdict of this kind at ``rows`` rows; a step that gave other numbers is never run again,
        and says so (a model or a transformers release this code does not describe)."""
        _VERDICTS[(*self.kind, rows)] = same
        if not same:
            fall_back(
                "lean decode step",
                f"its first step of kind {self.kind} at {rows} rows gave other logits or keys and values than "
                "the model's forward",
                "the model's own forward",
            )

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as autocast hands it to a product (cast once, not once per product)."""
        return x if self.low is None else x.to(self.low)


def _causal_lm(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM inside ``model`` (PEFT's wrapper taken off) where its class is lean."""
    inner = model
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and hasattr(base, "model"):
        inner = base.model  # PeftModelForCausalLM -> LoraModel -> the causal LM
    if type(inner).__name__ not in LEAN_CLASSES:
        return None
    config = inner.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    return inner


def _attention_function(causal_lm: nn.Module):
    """The attention function the model's layers call (``ALL_ATTENTION_FUNCTIONS``, or the module's eager one)."""
    name = causal_lm.config._attn_implementation
    if name == "eager":
        return sys.modules[type(causal_lm.model.layers[0].self_attn).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _hooked(model: nn.Module) -> bool:
    """Whether any module of ``model`` has forward hooks (FSDP's gathers, a profiler's, a user's): the lean
    step calls few modules' ``__call__``, so it would skip them."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
