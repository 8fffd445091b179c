"""Mechanics shared by the workers: cross-rank sums, equal micro-batch counts (FSDP2's collectives
need as many passes on every rank), clipping with non-finite skipping, sharded checkpoints."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.models.expert_parallel import reduce_expert_grads
from easyvlm.utils.dtypes import canonical_dtype
from easyvlm.workers.settings import FSDPConfig
from easyvlm.workers.specs import MicroBatching
from easyvlm.utils.safe_state import SafeFileSystemReader, SafeLoadPlanner, load_state, rng_state, set_rng_state
from easyvlm.workers.fsdp import DTYPES


def check_worker_group(rank: int, world_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "workers need torch.distributed initialised (one process per device); call "
            "easyvlm.workers.dist.init_distributed() before building a worker"
        )
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(
            f"worker built with rank={rank}, world_size={world_size} but the process group has "
            f"rank={dist.get_rank()}, world_size={dist.get_world_size()}"
        )


def model_dtype(fsdp: FSDPConfig, device: torch.device, gpu_default: torch.dtype) -> torch.dtype:
    """Parameter dtype: float32 on the CPU; on GPUs ``fsdp.torch_dtype`` or ``gpu_default``."""
    if device.type != "cuda":
        return torch.float32
    return gpu_default if fsdp.torch_dtype is None else DTYPES[canonical_dtype(fsdp.torch_dtype)]


def compute_dtype(fsdp: FSDPConfig, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP gathers the parameters in for the forward (mixed precision on GPUs); None = their own."""
    from easyvlm.workers.fsdp import fsdp_plan

    return fsdp_plan(fsdp, world_size(), device.type).param_dtype


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_max_int(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def check_same_batch_size(batch_size: int, device: torch.device, key: str) -> None:
    """Raise ValueError unless every rank holds as many samples (else FSDP's collectives would hang)."""
    largest = all_reduce_max_int(batch_size, device)
    smallest = -all_reduce_max_int(-batch_size, device)
    if largest != smallest:
        raise ValueError(
            f"{key}: ranks received between {smallest} and {largest} samples; the caller must give every "
            "rank the same number (Batch.chunk after Batch.pad_to_divisor)"
        )


def all_reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each value over ranks, in one collective. All ranks must pass the same keys."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if world_size() > 1 and keys:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def equalize_micro_batches(micros: list[Batch], device: torch.device) -> list[tuple[Batch, bool]]:
    """``(micro_batch, is_dummy)`` pairs, as many on every rank: a rank with fewer repeats its first
    micro-batch as a dummy (loss multiplied by 0, outputs dropped)."""
    target = all_reduce_max_int(len(micros), device)
    if not micros:
        raise ValueError("a worker received an empty batch; the caller must give every rank at least one sample")
    return [(m, False) for m in micros] + [(micros[0], True)] * (target - len(micros))


# ------------------------------------------------------------------------------------------------
# Optimizer step


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float, nonfinite_loss: bool
) -> tuple[float, bool]:
    """Clip gradients to ``max_grad_norm`` and step, unless the loss (on any rank) or the global
    gradient norm is not finite. Returns (grad_norm, stepped); gradients are zeroed either way."""
    reduce_expert_grads(model)  # expert parallelism: the experts' gradients as FSDP gives the others'
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(clip_grad_norm(params, max_grad_norm))
    stepped = not nonfinite_loss and bool(np.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """torch's ``clip_grad_norm_`` over several device meshes (DTensor cannot combine FSDP2's and the
    experts'); returns the total norm, a plain tensor."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    if len(by_mesh) <= 1:  # one mesh (or none): torch's own, as before expert parallelism
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).square().sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s
    torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
                         if p.grad is not None], coef)
    return total


# ------------------------------------------------------------------------------------------------
# Checkpoints: model + optimizer sharded with torch.distributed.checkpoint, the rest per rank


def save_sharded_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> None:
    """Write ``path/model_optim/`` (DCP: each rank its shards) and ``path/extra_state_rank{r}.pt``
    (scheduler and RNG states). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / "model_optim"))
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state()}, path / f"extra_state_rank{rank}.pt")
    if world_size() > 1:
        dist.barrier()
        check_shared_checkpoint_dir(path, rank, world_size())


SHARED_DIR_TIMEOUT_S = 30.0  # network file systems may show another client's new file a little later
NOT_SHARED = ("every rank writes its own shards into trainer.save_checkpoint_path on its own machine, so on a "
              "multi-node cluster that directory must be on storage that every node (and the driver) mounts at "
              "the same path, e.g. NFS or a cluster file system")


def check_shared_checkpoint_dir(path: Path, rank: int, world: int, timeout: float = SHARED_DIR_TIMEOUT_S) -> None:
    """After every rank saved into ``path``: RuntimeError unless this rank sees every rank's files."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world) if not (path / f"extra_state_rank{r}.pt").is_file()]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"checkpoint {path}: rank {rank} (host {socket.gethostname()}) does not see the files of rank(s) "
                f"{missing} there after {timeout:.0f} s: {NOT_SHARED}"
            )
        time.sleep(0.5)


def load_sharded_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> None:
    """Inverse of :func:`save_sharded_checkpoint` (same world size; ``safe_state`` unpickling). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    extra_file = path / f"extra_state_rank{rank}.pt"
    if not (path / "model_optim").is_dir() or not extra_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a worker checkpoint of this world size (needs model_optim/ and {extra_file.name}) "
            f"as rank {rank} (host {socket.gethostname()}) sees it; if the driver found it complete: {NOT_SHARED}"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    model_optim = path / "model_optim"
    dcp.load(state, storage_reader=SafeFileSystemReader(model_optim), planner=SafeLoadPlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = load_state(extra_file)
    scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])


def token_budget(micro: MicroBatching, batch: Batch) -> int | None:
    """Dynamic batching's token budget per micro-batch (None when off); see ``MicroBatching.max_token_len``."""
    if not micro.dynamic:
        return None
    return micro.max_token_len or micro.micro_batch_size * batch["input_ids"].shape[1]
