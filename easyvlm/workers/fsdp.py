"""FSDP2 wrapping, full state-dict gathering and GPU offload helpers.

``apply_fsdp`` calls ``torch.distributed.fsdp.fully_shard`` on every decoder block and vision
block (the model's ``_no_split_modules``), then on the root; all ranks form one data-parallel
mesh. On GPUs the parameters are computed in ``mp_param_dtype`` (bf16 by default) with gradients
reduced in ``mp_reduce_dtype``; on the CPU everything stays float32 (no mixed precision).

FSDP averages gradients over ranks; the actor multiplies its loss by the world size so that the
result is the global sum (see ``easyvlm/algorithms/aggregation.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

logger = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype, key: str = "fsdp dtype") -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r} is not a dtype; valid: {sorted(DTYPES)}")
    return DTYPES[name]


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of the blocks to shard one by one: the union of ``_no_split_modules`` of every
    transformers model inside ``model`` (e.g. Qwen2_5_VLDecoderLayer, Qwen2_5_VLVisionBlock)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def apply_fsdp(model: nn.Module, fsdp_config: Any, device: torch.device) -> nn.Module:
    """Shard ``model`` in place over all ranks of the default process group; returns it.

    fsdp_config: easyvlm ``FSDPConfig`` (enable_full_shard, enable_cpu_offload, mp_param_dtype,
    mp_reduce_dtype). Mixed precision and CPU offload are used on CUDA devices only.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError(
            "apply_fsdp needs torch.distributed initialised; call easyvlm.workers.dist.init_distributed() first"
        )
    fsdp_size = getattr(fsdp_config, "fsdp_size", -1)
    if fsdp_size not in (-1, None, dist.get_world_size()):
        logger.warning("fsdp.fsdp_size=%s (hybrid sharding) is not supported; sharding over all %d ranks",
                       fsdp_size, dist.get_world_size())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    on_gpu = device.type == "cuda"
    if on_gpu:
        param_dtype = getattr(fsdp_config, "mp_param_dtype", "bf16")
        reduce_dtype = getattr(fsdp_config, "mp_reduce_dtype", "fp32")
        mp_policy = MixedPrecisionPolicy(
            param_dtype=parse_dtype(param_dtype, torch.bfloat16, "fsdp.mp_param_dtype"),
            reduce_dtype=parse_dtype(reduce_dtype, torch.float32, "fsdp.mp_reduce_dtype"),
        )
    else:
        mp_policy = MixedPrecisionPolicy()  # the CPU computes in the parameters' dtype (float32)
    offload = CPUOffloadPolicy() if on_gpu and getattr(fsdp_config, "enable_cpu_offload", False) else OffloadPolicy()
    kwargs = dict(
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        # enable_full_shard=False keeps parameters gathered between forward and backward (ZeRO-2)
        reshard_after_forward=bool(getattr(fsdp_config, "enable_full_shard", True)),
    )
    blocks = block_class_names(model)
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


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
    state = {}
    for name, value in model.state_dict().items():
        state[name] = full_tensor(value).detach().to(device)
    lora = _lora_scaling(model)
    if lora is not None:
        state = merge_lora_state_dict(state, lora)
    return state


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
# Offload between phases (GPU only; no-ops on the CPU)


def offload_model(model: nn.Module) -> None:
    """Move the (sharded) parameters and buffers to CPU memory, freeing the GPU for rollout."""
    if _on_cuda(model):
        model.to("cpu", non_blocking=True)
        torch.cuda.empty_cache()


def load_model_to(model: nn.Module, device: torch.device) -> None:
    if device.type == "cuda" and not _on_cuda(model):
        model.to(device, non_blocking=True)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    _move_optimizer_state(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    if device.type == "cuda":
        _move_optimizer_state(optimizer, device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _on_cuda(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"
