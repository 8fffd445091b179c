"""FSDP2 wrapping, full state-dict gathering and GPU offload helpers.

``fsdp_plan(fsdp, world_size, device_type)`` turns the ``FSDPConfig`` of a role into an
:class:`FSDPPlan` (a pure function, so the GPU choices are testable on the CPU);
``apply_fsdp(model, fsdp, device)`` carries it out: ``fully_shard`` on every decoder block and
vision block (the model's ``_no_split_modules``), then on the root. What each key does:

- ``fsdp_size``: -1 (or the world size) shards every parameter over all ranks; a divisor k of the
  world size gives hybrid sharding (HSDP): a 2-D mesh of world/k replicas x k shards, parameters
  sharded within a group of k ranks and replicated across groups, gradients reduce-scattered within
  the group and all-reduced across groups (the averaged gradient is the same as with -1).
- ``enable_full_shard``: False keeps parameters gathered between forward and backward (ZeRO-2).
- ``mp_param_dtype`` / ``mp_reduce_dtype`` (CUDA only): FSDP2's ``MixedPrecisionPolicy``.
- ``mp_buffer_dtype`` (CUDA only): FSDP2 has no buffer policy, so ``apply_fsdp`` casts the model's
  floating-point buffers itself (:func:`cast_buffers`, before sharding), except rotary
  frequencies (``inv_freq``, ``original_inv_freq``), which stay float32: rounded to bfloat16 they
  are off by up to 2**-9 relative, which turns the highest frequency's angle at position 4096 by
  up to 8 rad.
- ``enable_cpu_offload`` (CUDA only): FSDP2's ``CPUOffloadPolicy``.
- ``enable_rank0_init``: rank 0 reads the weights; the other ranks build the model on the meta
  device (``load_model(..., on_meta=True)``: no file read, no host memory for weights). After
  sharding, the meta ranks allocate their shards and rank 0 broadcasts its full state dict
  (``set_model_state_dict(..., broadcast_from_rank0=True)``) and then every buffer, which covers
  the non-persistent ones (rotary ``inv_freq``) that the state dict leaves out.
- ``use_orig_params``: FSDP1's flag; FSDP2 always keeps the original parameters (one DTensor per
  parameter, frozen and trainable ones side by side), so both values behave alike: a no-op.
- ``torch_dtype``: the dtype the weights are loaded in (``easyvlm.workers.training.model_dtype``).

On the CPU everything stays float32: no mixed precision, no buffer cast, no CPU offload (the
parameters are in CPU memory already). This is a choice: CPU runs are for tests and small models,
where float32 keeps results comparable with transformers' own forward.

FSDP averages gradients over ranks; the actor multiplies its loss by the world size so that the
result is the global sum (see ``easyvlm/algorithms/aggregation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
    """What ``apply_fsdp`` does for one role on one machine layout (see :func:`fsdp_plan`)."""

    mesh_shape: tuple[int, ...]
    """(world,) to shard over all ranks, or (replicas, shards) for hybrid sharding."""
    mesh_dim_names: tuple[str, ...]
    """("shard",) or ("replicate", "shard"): FSDP2 replicates over dim 0 of a 2-D mesh, shards over dim 1."""
    param_dtype: torch.dtype | None
    """Dtype of the gathered parameters in forward and backward; None = the parameters' own."""
    reduce_dtype: torch.dtype | None
    """Dtype of the gradient reduction; None = the gradients' own."""
    buffer_dtype: torch.dtype | None
    """Floating buffers (rotary frequencies excepted) are cast to it before sharding; None = kept."""
    reshard_after_forward: bool
    cpu_offload: bool
    """FSDP2 keeps the sharded parameters (and gradients, optimizer states) in CPU memory."""
    rank0_init: bool
    """Only rank 0 reads the weights; the others build on the meta device and receive them."""

    def loads_weights(self, rank: int) -> bool:
        """Whether ``rank`` reads the weights from disk (else: ``load_model(..., on_meta=True)``)."""
        return rank == 0 or not self.rank0_init


def fsdp_plan(fsdp: FSDPConfig, world_size: int, device_type: str, key: str = "fsdp") -> FSDPPlan:
    """The FSDP plan of a role with ``fsdp`` settings on ``world_size`` ranks of ``device_type``
    ("cuda" or "cpu"). Raises ValueError for an ``fsdp_size`` that does not divide the world size,
    naming ``{key}.fsdp_size`` (pass e.g. ``key="worker.actor.fsdp"``). Pure: the driver can call
    it when it checks the config, the worker when it builds its model."""
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
    """Cast the floating-point buffers of ``model`` to ``dtype`` in place, rotary frequencies
    (:data:`ROTARY_BUFFERS`) excepted."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and name not in ROTARY_BUFFERS:
                module._buffers[name] = buffer.to(dtype)


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of the blocks to shard one by one: the union of ``_no_split_modules`` of every
    transformers model inside ``model`` (e.g. Qwen2_5_VLDecoderLayer, Qwen2_5_VLVisionBlock)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def apply_fsdp(
    model: nn.Module, fsdp: FSDPConfig, device: torch.device, *, key: str = "fsdp", shard_vision_blocks: bool = True,
    expert_parallel_size: int = 1,
) -> nn.Module:
    """Shard ``model`` in place as ``fsdp_plan(fsdp, world_size, device.type)`` says, over all
    ranks of the default process group; returns it. Collective: every rank calls it alike.

    With rank-0 init (``fsdp_plan(...).loads_weights(rank)`` False on ranks > 0), rank 0 passes
    the model loaded from disk and the other ranks the same model built with
    ``load_model(..., on_meta=True)``; all ranks end with rank 0's parameters and buffers.
    ``key`` names the role's fsdp section in errors (e.g. ``worker.actor.fsdp``).
    ``shard_vision_blocks=False`` (a frozen tower behind the vision cache, easyvlm.models.vision_cache):
    the tower's blocks join the root's unit, so running the tower on one rank only needs no collective.
    ``expert_parallel_size`` > 1 (MoE models): each rank keeps its share of the experts, which FSDP
    leaves alone (``easyvlm.models.expert_parallel``).
    """
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
    """Give every rank rank 0's weights: parameters and persistent buffers through the state dict,
    then every buffer by broadcast (non-persistent ones such as rotary ``inv_freq`` are not in
    the state dict, and on the meta ranks they hold garbage after ``to_empty``)."""
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
    """The full (unsharded) state dict, on every rank, with the in-memory transformers 5 names.

    Names are those of ``model.state_dict()`` (``model.language_model.layers.0...``,
    ``model.visual...``, ``lm_head.weight``): vLLM's ``reload_weights`` needs these, not the file
    names of ``save_pretrained``. A PEFT LoRA model comes back merged (W + alpha/r * B @ A) under
    the base model's names. Collective: every rank must call it. Tensors are moved to ``device``
    one at a time, so the GPU never holds more than one gathered tensor.
    """
    state = dict(_full_tensors(model, device))
    lora = _lora_scaling(model)
    if lora is not None:
        state = merge_lora_state_dict(state, lora)
    return state


def iter_full_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """:func:`gather_full_state_dict` one tensor at a time: (name, full tensor on ``device``), so that a
    consumer on the same device (the hybrid worker's engine) copies each into place before the next is
    gathered, with no host round trip. A LoRA model cannot be merged a tensor at a time: it yields the
    merged dict's items (gathered first). Collective: every rank must consume the whole iterator, in order."""
    if _lora_scaling(model) is not None:
        yield from gather_full_state_dict(model, device).items()
    else:
        yield from _full_tensors(model, device)


def _full_tensors(model: nn.Module, device: torch.device | str) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor on ``device``) of ``model.state_dict()``, gathered one at a time."""
    for name, value in model.state_dict().items():
        yield name, full_tensor(value).detach().to(device)


def _lora_scaling(model: nn.Module) -> float | None:
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config["default"]
    if getattr(cfg, "use_rslora", False):
        return cfg.lora_alpha / cfg.r**0.5
    return cfg.lora_alpha / cfg.r


_PEFT_PREFIX = "base_model.model."


def merge_lora_state_dict(state: dict[str, Tensor], scaling: float, adapter: str = "default") -> dict[str, Tensor]:
    """Fold LoRA adapters into base weights: ``X.base_layer.weight + scaling * X.lora_B @ X.lora_A``
    becomes ``X.weight``; adapter tensors are dropped and PEFT's ``base_model.model.`` prefix removed."""
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
            name = f"{layer}.{leaf}"
        out[name.removeprefix(_PEFT_PREFIX)] = value
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
