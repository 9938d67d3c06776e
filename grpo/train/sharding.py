"""FSDP2 for the GRPO policy: ``accelerate launch --config_file configs/accelerate/fsdp.yaml``.

The trainer shards its policy when accelerate says the launch is FSDP (``distributed_type: FSDP`` in
the launch config, i.e. ``ACCELERATE_USE_FSDP=true`` in the processes' environment), the switch a user
of accelerate already turns. Without it (DDP config, torchrun, one process) the weights stay
replicated and the step all-reduces whole per-task gradients.

What sharding means for each part of a step:

- wrapping: ``fully_shard`` on every decoder layer (the model's ``_no_split_modules``, accelerate's
  TRANSFORMER_BASED_WRAP) and on the root, as ``tests/sharded_step.py`` does. A LoRA policy is
  sharded as it is: FSDP2 keeps frozen and trainable parameters in one unit, only the trainable ones
  get gradients; the reference is the same model with the adapter disabled (I9), which needs no
  communication of its own. Under full fine-tuning the frozen reference copy stays replicated.
- gradients: reduce-scattered by SUM (each process's losses are already scaled by their share of the
  global batch, ``step._micro_rows``); the per-task combination works on each process's shard
  (``grpo.core.grad_space.ShardedGradSpace``), clipping on the norm of the whole gradient.
- rollout: the layers are gathered once for the whole rollout (``gathered``): processes generate
  different numbers of tokens, and a per-token all-gather would leave one waiting for the other.
- checkpoints and the final save: taken inside ``gathered``, so they hold full tensors and load on
  any number of processes, sharded or not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from grpo.config import Config, ConfigError
from grpo.core.grad_space import REPLICATED, GradSpace, ShardedGradSpace
from grpo.train import collectives


def fsdp_requested(accelerator: Accelerator) -> bool:
    """Whether this launch asks for FSDP: accelerate's FSDP plugin is active, or its launch variable is
    set (accelerate keeps it off for CPU processes; the CPU tests set it under torchrun)."""
    return accelerator.distributed_type == DistributedType.FSDP or parse_flag_from_env("ACCELERATE_USE_FSDP")


def policy_sharder(
    cfg: Config, accelerator: Accelerator
) -> Callable[[torch.nn.Module], torch.nn.Module] | None:
    """What ``build_policy`` applies to the policy before its optimizer sees the parameters: FSDP2
    sharding when the launch asks for it, else nothing."""
    if not fsdp_requested(accelerator):
        return None
    check_supported(cfg)
    return lambda model: shard_model(model, accelerator.num_processes, accelerator.device)


def check_supported(cfg: Config) -> None:
    """The combinations FSDP cannot run, refused before any weight is loaded."""
    if cfg.grpo.rollout.engine == "vllm":
        raise ConfigError(
            "params.yaml: grpo.rollout.engine is 'vllm' but the launch config asks for FSDP: the vLLM "
            "engine reads whole weights from the trainer's model. Set grpo.rollout.engine: hf, or launch "
            "with configs/accelerate/ddp.yaml"
        )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules accelerate's TRANSFORMER_BASED_WRAP would wrap: those of ``_no_split_modules``."""
    classes: set[str] = set()
    for module in model.modules():
        classes |= set(getattr(module, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in classes]


def shard_model(model: torch.nn.Module, world_size: int, device: torch.device) -> torch.nn.Module:
    """``model`` sharded in place with FSDP2 over ``world_size`` processes; gradients summed, not averaged."""
    layers = _decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"FSDP: {type(model).__name__} names no decoder layer class in _no_split_modules; "
            "launch with configs/accelerate/ddp.yaml for this model"
        )
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # the losses are pre-scaled to the global batch: SUM
        module.set_force_sum_reduction_for_comms(True)
    return model


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def grad_space(model: torch.nn.Module, accelerator: Accelerator) -> GradSpace:
    """How the step reads and combines this model's gradients (``grpo/core/grad_space.py``)."""
    if not is_sharded(model):
        return REPLICATED
    return ShardedGradSpace(functools.partial(collectives.sum_tensor, accelerator))


@contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    # FSDP2 picks its root at the first forward that runs; settle it on the policy's root before the
    # rollout (which may run first) calls any forward.
    model._get_fsdp_state()._lazy_init()
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)  # as shard_model wrapped them


def gathered(model: torch.nn.Module):
    """Within it, ``model``'s parameters are whole on every process (plain tensors under their usual
    names) and forwards communicate nothing; a no-op for an unsharded model. Every process must
    enter it together (the gather is a collective)."""
    return _gathered(model) if is_sharded(model) else nullcontext()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every process calls it), or ``tensor`` itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` cut as ``param`` is sharded (this process's chunk, no communication), or ``full``."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a view: writing into it writes the shard), or ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The state dict to save of a sharded model as whole CPU tensors (a collective: every process
    calls it); a LoRA policy gathers only its adapter. None for an unsharded model (it saves itself)."""
    if not is_sharded(model):
        return None
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    adapter_only = hasattr(model, "peft_config")
    return {
        name: full_tensor(value.detach()).cpu()
        for name, value in model.state_dict().items()
        if not adapter_only or name in trainable
    }
