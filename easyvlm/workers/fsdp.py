"""FSDP2 wrapping (:func:`fsdp_plan`, pure so the GPU choices are tested on the CPU), full state-dict
gathering and GPU offload; each key: docs/workers.md, "FSDP2"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from easyvlm.rollout.lora import lora_base_name
from easyvlm.utils.dtypes import canonical_dtype
from easyvlm.workers.settings import FSDPConfig

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}

# Buffers that stay float32 whatever mp_buffer_dtype says (see the module docstring).
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


@dataclass(frozen=True)
class FSDPPlan:
    """What ``apply_fsdp`` does for one role on one machine layout."""

    mesh_shape: tuple[int, ...]
    """(world,) to shard over all ranks, or (replicas, shards) for hybrid sharding."""
    mesh_dim_names: tuple[str, ...]
    """("shard",) or ("replicate", "shard"): FSDP2 replicates over dim 0 of a 2-D mesh, shards over dim 1."""
    param_dtype: torch.dtype | None
    """Dtype of the gathered parameters (``reduce_dtype``: of the gradient reduction); None = their own."""
    reduce_dtype: torch.dtype | None
    buffer_dtype: torch.dtype | None
    """Floating buffers (rotary frequencies excepted) are cast to it before sharding; None = kept."""
    reshard_after_forward: bool
    cpu_offload: bool
    """The sharded parameters, gradients and optimizer states live in CPU memory."""
    rank0_init: bool
    """Only rank 0 reads the weights; the others build on the meta device and receive them."""

    def loads_weights(self, rank: int) -> bool:
        """Whether ``rank`` reads the weights from disk (else: ``load_model(..., on_meta=True)``)."""
        return rank == 0 or not self.rank0_init


def fsdp_plan(fsdp: FSDPConfig, world_size: int, device_type: str, key: str = "fsdp") -> FSDPPlan:
    """The FSDP plan of a role on ``world_size`` ranks of ``device_type``. Raises ValueError, naming
    ``{key}.fsdp_size``, for one that does not divide the world size."""
    if fsdp.fsdp_size in (-1, world_size):
        shape, names = (world_size,), ("shard",)
    elif 1 <= fsdp.fsdp_size < world_size and world_size % fsdp.fsdp_size == 0:
        shape, names = (world_size // fsdp.fsdp_size, fsdp.fsdp_size), ("replicate", "shard")
    else:
        raise ValueError(
            f"{key}.fsdp_size={fsdp.fsdp_size} with {world_size} ranks: it must be -1 (shard over all ranks) or "
            f"a divisor of the number of ranks (hybrid sharding: world / fsdp_size replicas of fsdp_size shards)"
        )
    cuda = device_type == "cuda"
    return FSDPPlan(
        mesh_shape=shape,
        mesh_dim_names=names,
        param_dtype=DTYPES[canonical_dtype(fsdp.mp_param_dtype)] if cuda else None,
        reduce_dtype=DTYPES[canonical_dtype(fsdp.mp_reduce_dtype)] if cuda else None,
        buffer_dtype=DTYPES[canonical_dtype(fsdp.mp_buffer_dtype)] if cuda else None,
        reshard_after_forward=fsdp.enable_full_shard,
        cpu_offload=cuda and fsdp.enable_cpu_offload,
        rank0_init=fsdp.enable_rank0_init and world_size > 1,
    )


def fully_shard_kwargs(plan: FSDPPlan) -> dict[str, Any]:
    """``fully_shard`` keyword arguments of ``plan``, without the mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype),
        offload_policy=CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy(),
        reshard_after_forward=plan.reshard_after_forward,
    )


def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating buffers to ``dtype`` in place, :data:`ROTARY_BUFFERS` excepted."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and name not in ROTARY_BUFFERS:
                module._buffers[name] = buffer.to(dtype)


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of the blocks to shard one by one: every inner model's ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def apply_fsdp(
    model: nn.Module, fsdp: FSDPConfig, device: torch.device, *, key: str = "fsdp", shard_vision_blocks: bool = True,
    expert_parallel_size: int = 1,
) -> nn.Module:
    """Shard ``model`` in place as :func:`fsdp_plan` says; returns it. Collective; under rank-0 init the
    other ranks pass the meta model. ``shard_vision_blocks=False`` keeps a frozen cached tower in the
    root's unit; ``expert_parallel_size`` > 1 leaves the experts to ``models.expert_parallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from easyvlm.models.loading import get_vision_tower

    if not dist.is_initialized():
        raise RuntimeError(
            "apply_fsdp needs torch.distributed initialised; call easyvlm.workers.dist.init_distributed() first"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    plan = fsdp_plan(fsdp, world_size, device.type, key)
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if on_meta and not (plan.rank0_init and rank != 0):
        raise ValueError(
            f"apply_fsdp: rank {rank} got a model on the meta device, but with {key}.enable_rank0_init="
            f"{fsdp.enable_rank0_init} on {world_size} ranks it receives no weights; build it with "
            "load_model(..., on_meta=not fsdp_plan(...).loads_weights(rank))"
        )
    # rank 0's full weights (the tensors themselves, no copy); fully_shard replaces the parameters
    full_state = model.state_dict() if plan.rank0_init and rank == 0 else {}
    if plan.buffer_dtype is not None:
        cast_buffers(model, plan.buffer_dtype)

    mesh = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    kwargs = fully_shard_kwargs(plan)
    if expert_parallel_size > 1:
        from easyvlm.models.expert_parallel import expert_parallel_group, shard_experts

        experts = shard_experts(model, expert_parallel_group(expert_parallel_size, device), device)
        kwargs["ignored_params"] = set(experts)
    blocks = block_class_names(model)
    tower = get_vision_tower(model)
    unsharded = set() if shard_vision_blocks or tower is None else set(tower.modules())
    for module in list(model.modules()):
        if type(module).__name__ in blocks and module not in unsharded:
            fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)

    if plan.rank0_init:
        _receive_from_rank0(model, plan, full_state, device, on_meta)
    return model


def _receive_from_rank0(
    model: nn.Module, plan: FSDPPlan, full_state: dict[str, Tensor], device: torch.device, on_meta: bool
) -> None:
    """Give every rank rank 0's weights, buffers broadcast too (rotary ``inv_freq`` is not in the state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if on_meta:
        # allocate (uninitialised) shards where FSDP keeps them: CPU memory under CPU offload
        model.to_empty(device="cpu" if plan.cpu_offload else device)
        for module in model.modules():  # buffers are not offloaded: the forward needs them on device
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_full_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The full state dict on every rank under the in-memory transformers names (not
    ``save_pretrained``'s), a LoRA model merged. Collective; tensors move to ``device`` one at a time."""
    state = dict(_full_tensors(model, device))
    lora = _lora_scaling(model)
    if lora is not None:
        state = merge_lora_state_dict(state, lora)
    return state


def iter_full_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """:func:`gather_full_state_dict` one (name, tensor on ``device``) at a time. Collective: every rank
    must consume the whole iterator, in order."""
    if _lora_scaling(model) is not None:
        yield from gather_full_state_dict(model, device).items()
    else:
        yield from _full_tensors(model, device)


def _full_tensors(model: nn.Module, device: torch.device | str) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor on ``device``) of ``model.state_dict()``, gathered one at a time."""
    for name, value in model.state_dict().items():
        yield name, full_tensor(value).detach().to(device)


def iter_lora_base_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """A LoRA model's base weights under the base model's names, as :func:`iter_full_state_dict`."""
    for name, value in model.state_dict().items():
        if ".lora_" not in name:
            yield lora_base_name(name), full_tensor(value).detach().to(device)


def iter_lora_adapter(model: nn.Module, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """The adapter tensors that train (PEFT's in-memory names), as :func:`iter_full_state_dict`."""
    for name, param in model.named_parameters():
        if ".lora_" in name and param.requires_grad:
            yield name, full_tensor(param).detach().to(device)


def _lora_scaling(model: nn.Module) -> float | None:
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config["default"]
    if getattr(cfg, "use_rslora", False):
        return cfg.lora_alpha / cfg.r**0.5
    return cfg.lora_alpha / cfg.r


def merge_lora_state_dict(state: dict[str, Tensor], scaling: float, adapter: str = "default") -> dict[str, Tensor]:
    """``X.weight = X.base_layer.weight + scaling * X.lora_B @ X.lora_A``, under the base model's names."""
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            layer, _, leaf = name.partition(".base_layer.")
            lora_a = state.get(f"{layer}.lora_A.{adapter}.weight")  # (r, in)
            lora_b = state.get(f"{layer}.lora_B.{adapter}.weight")  # (out, r)
            if leaf == "weight" and lora_a is not None and lora_b is not None:
                value = value + (scaling * (lora_b.float() @ lora_a.float())).to(value.dtype)
        out[lora_base_name(name)] = value
    return out


# ------------------------------------------------------------------------------------------------
# Offload between phases (GPU only; no-ops on the CPU), through host buffers allocated once and
# pinned, one set per model and per optimizer (easyvlm/workers/host_offload.py says why)

from easyvlm.workers.host_offload import mirror_of, model_tensors, optimizer_tensors  # noqa: E402


def offload_model(model: nn.Module) -> None:
    """Move the (sharded) parameters and buffers to host memory, freeing the GPU for rollout."""
    if _on_cuda(model):
        mirror_of(model).park(model_tensors(model))
        torch.cuda.empty_cache()


def load_model_to(model: nn.Module, device: torch.device) -> None:
    mirror = mirror_of(model)
    if device.type == "cuda" and mirror.parked:
        mirror.restore(device)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    tensors = optimizer_tensors(optimizer)
    if any(t.is_cuda for t in tensors):  # none before the first step: Adam's state is made by it
        mirror_of(optimizer).park(tensors)
        torch.cuda.empty_cache()


def load_optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    mirror = mirror_of(optimizer)
    if device.type == "cuda" and mirror.parked:
        mirror.restore(device)


def _on_cuda(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"
