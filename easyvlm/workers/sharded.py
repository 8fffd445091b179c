"""Build a role's model sharded over the ranks: load (rank 0 only with ``enable_rank0_init``), then FSDP2."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from easyvlm.workers.settings import FSDPConfig
from easyvlm.models.cpu_linear import onednn_linear_available, use_onednn_linears
from easyvlm.models.loading import ModelRole, load_model
from easyvlm.models.moe_routing import is_moe_config
from easyvlm.models.specs import ModelSpec
from easyvlm.workers.fsdp import apply_fsdp, fsdp_plan


def build_sharded_model(
    spec: ModelSpec,
    fsdp: FSDPConfig,
    *,
    role: ModelRole,
    dtype: torch.dtype,
    padding_free: bool,
    trainable: bool,
    device: torch.device,
    rank: int,
    key: str,
    shard_vision_blocks: bool = True,
    expert_parallel_size: int = 1,
) -> nn.Module:
    """The model of ``spec`` under FSDP2 as ``fsdp`` (config key ``key``) asks. Collective. On the CPU
    its float32 linear layers run through oneDNN. Other arguments: see ``apply_fsdp``."""
    plan = fsdp_plan(fsdp, dist.get_world_size(), device.type, key=key)
    loaded = load_model(
        spec, role=role, dtype=dtype, padding_free=padding_free, trainable=trainable, on_meta=not plan.loads_weights(rank)
    )
    if device.type == "cpu" and dtype == torch.float32 and onednn_linear_available():
        use_onednn_linears(loaded.model)
    experts = expert_parallel_size if is_moe_config(spec.hf_config) else 1
    return apply_fsdp(loaded.model, fsdp, device, key=key, shard_vision_blocks=shard_vision_blocks,
                      expert_parallel_size=experts)
