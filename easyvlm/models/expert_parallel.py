"""Expert parallelism (``expert_parallel_size`` = e): rank j of e consecutive ranks holds experts
[j E/e, (j+1) E/e) as a DTensor outside FSDP; tokens reach their experts' ranks and return by all-to-all.
docs/models.md, "Expert parallelism"."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

EXPERT_PARALLEL = "easyvlm_expert_parallel"
"""The experts implementation name easyvlm registers in transformers' ``ExpertsInterface``."""


@dataclass(frozen=True)
class ExpertParallelLayout:
    """Where rank ``rank`` of ``world_size`` sits with expert_parallel_size ``size`` (pure)."""

    size: int
    """Ranks per expert-parallel group (e)."""
    group_ranks: tuple[int, ...]
    """The ranks of this rank's EP group (consecutive)."""
    index: int
    """This rank's place in its EP group: it holds experts [index E/e, (index+1) E/e)."""
    replica_ranks: tuple[int, ...]
    """The ranks holding the same experts (one per EP group): the expert-data-parallel group."""

    def local_experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.size
        return range(self.index * per_rank, (self.index + 1) * per_rank)


def expert_parallel_layout(rank: int, world_size: int, size: int) -> ExpertParallelLayout:
    """The layout of ``rank``: EP groups of ``size`` consecutive ranks (within a node on GPUs);
    ``size`` must divide ``world_size``."""
    if size < 1 or world_size % size:
        raise ValueError(f"expert_parallel_size={size} must be >= 1 and divide the {world_size} ranks")
    start = rank - rank % size
    return ExpertParallelLayout(
        size=size, group_ranks=tuple(range(start, start + size)), index=rank % size,
        replica_ranks=tuple(range(rank % size, world_size, size)),
    )


@dataclass
class ExpertParallelGroup:
    """A rank's expert-parallel process groups (built once per worker, collectively)."""

    layout: ExpertParallelLayout
    mesh: Any
    """The 1-D device mesh of the EP group: the experts' DTensors live on it."""
    replica_group: Any
    """The EDP process group (None when world == e: nothing to sum)."""
    world_size: int

    @property
    def group(self) -> Any:
        return self.mesh.get_group()


def expert_parallel_group(size: int, device: torch.device) -> ExpertParallelGroup:
    """The EP and EDP groups of this rank. Collective: every rank calls it with the same ``size``."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = expert_parallel_layout(rank, world, size)
    # (replicas, e): dim 1 holds the EP groups (consecutive ranks), dim 0 the EDP groups
    mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("expert_replicas", "experts"))
    # the mesh's groups are the layout's (its row-major ranks): what shard_experts' slices assume
    assert tuple(mesh["experts"].mesh.tolist()) == layout.group_ranks, (mesh, layout)
    assert tuple(mesh["expert_replicas"].mesh.tolist()) == layout.replica_ranks, (mesh, layout)
    replicas = mesh["expert_replicas"].get_group() if world > size else None
    return ExpertParallelGroup(layout=layout, mesh=mesh["experts"], replica_group=replicas, world_size=world)


# ------------------------------------------------------------------------------------------------
# The model: which modules are experts, and sharding them


EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The fused expert tensors of the MoE families easyvlm trains, (E, ...) each."""


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model`` (transformers' ``use_experts_implementation`` classes)."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and all(
        isinstance(getattr(m, name, None), nn.Parameter) for name in EXPERT_PARAMS)]


def shard_experts(model: nn.Module, ep: ExpertParallelGroup, device: torch.device) -> list[nn.Parameter]:
    """Keep only this rank's experts of every MoE layer (a DTensor of the full (E, ...) tensor, sharded on dim 0
    over the EP group), routed through :func:`expert_parallel_forward`. Every rank passes the full (or meta)
    model; the pieces go to ``device``. Returns the new parameters, for FSDP to ignore."""
    from torch.distributed.tensor import DTensor, Shard

    register_expert_parallel()
    sharded: list[nn.Parameter] = []
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no MoE experts to split over ranks")
    for module in modules:
        if module.num_experts % ep.layout.size:
            raise ValueError(f"{module.num_experts} experts cannot be split over expert_parallel_size={ep.layout.size} ranks")
        local = ep.layout.local_experts(module.num_experts)
        for name in EXPERT_PARAMS:
            full = getattr(module, name)
            piece = full.detach()[local.start : local.stop].to("meta" if full.is_meta else device, copy=True)
            param = nn.Parameter(DTensor.from_local(piece, ep.mesh, [Shard(0)], run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(module, name, param)
            sharded.append(param)
        module.expert_parallel = ep
        module.config._experts_implementation_internal = EXPERT_PARALLEL
    return sharded


def reduce_expert_grads(model: nn.Module) -> None:
    """Turn the experts' local gradients into the global sum FSDP gives the other parameters (the
    loss is scaled by the world size W): summed over the EDP group, divided by W."""
    for module in model.modules():
        ep = getattr(module, "expert_parallel", None)
        if ep is None:
            continue
        for name in EXPERT_PARAMS:
            grad = getattr(module, name).grad
            if grad is None:
                continue
            local = grad.to_local()
            if ep.replica_group is not None:
                dist.all_reduce(local, group=ep.replica_group)
            local.div_(ep.world_size)


# ------------------------------------------------------------------------------------------------
# The forward


def register_expert_parallel() -> None:
    """Register :func:`expert_parallel_forward` with transformers' ``ExpertsInterface``, once."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if EXPERT_PARALLEL not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(EXPERT_PARALLEL, expert_parallel_forward)


def expert_parallel_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """(N, H) outputs of the MoE layer ``self`` (after :func:`shard_experts`) for its tokens'
    ``top_k_index`` / ``top_k_weights`` (N, k). Collective over the EP group."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    ep: ExpertParallelGroup = self.expert_parallel
    size, num_experts = ep.layout.size, self.num_experts
    per_rank = num_experts // size
    tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)  # (S,) S = N k pairs, pair p = token p // k
    order = torch.argsort(experts, stable=True)  # pairs grouped by expert, hence by destination rank
    sent_per_expert = torch.bincount(experts, minlength=num_experts)  # (E,)
    # recv[j, l]: pairs rank j of the group sends to this rank's local expert l
    recv = torch.empty_like(sent_per_expert)
    dist.all_to_all_single(recv, sent_per_expert, group=ep.group)
    recv = recv.reshape(size, per_rank)
    send_splits = sent_per_expert.reshape(size, per_rank).sum(-1).tolist()
    recv_splits = recv.sum(-1).tolist()

    outbound = hidden_states[order // k]  # (S, H)
    # rows by source rank, then by local expert
    inbound = wait_tensor(all_to_all_single_autograd(outbound, recv_splits, send_splits, ep.group))
    local_expert = torch.repeat_interleave(torch.arange(per_rank, device=recv.device).repeat(size), recv.reshape(-1))
    computed = _local_grouped_forward(self, ep, inbound, local_expert)  # (R, H)
    returned = wait_tensor(all_to_all_single_autograd(computed, send_splits, recv_splits, ep.group))  # (S, H) in ``order``
    weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
    out = torch.zeros_like(weighted).index_copy(0, order, weighted)  # back to pair order
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _local_grouped_forward(module: nn.Module, ep: ExpertParallelGroup, rows: Tensor, local_expert: Tensor) -> Tensor:
    """Each of ``rows`` (R, H) through its local expert ``local_expert`` (R,) as grouped products."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    local = SimpleNamespace(
        gate_up_proj=module.gate_up_proj.to_local().to(rows.dtype), down_proj=module.down_proj.to_local().to(rows.dtype),
        num_experts=module.num_experts // ep.layout.size, has_gate=module.has_gate, has_bias=module.has_bias,
        is_transposed=module.is_transposed, _is_expert_parallel=False, act_fn=module.act_fn,
    )
    local._apply_gate = lambda out: type(module)._apply_gate(local, out)
    return grouped_mm_experts_forward(local, rows, local_expert[:, None], rows.new_ones(rows.shape[0], 1))
