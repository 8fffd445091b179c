"""Mechanics shared by the trainable workers (actor, critic): equal micro-batch counts across ranks,
the vision-tower dummy, cross-rank sums, clipping with non-finite skipping, sharded checkpoints.

Why equal counts and a dummy image: FSDP2 all-gathers each block's parameters in its forward and
reduce-scatters its gradients in the backward, as collectives. Every rank must therefore run the
same number of forward/backward passes, and the vision tower in each of them, even when its own
micro-batch has fewer samples or no image at all.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.workers.forward import MULTI_MODAL_KEY


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_max_int(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each value over ranks, in one collective. All ranks must pass the same keys."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if world_size() > 1 and keys:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def equalize_micro_batches(micros: list[Batch], device: torch.device) -> list[tuple[Batch, bool]]:
    """``(micro_batch, is_dummy)`` pairs, as many on every rank: a rank with fewer micro-batches
    repeats its first one as a dummy (its loss is multiplied by 0 and its outputs dropped)."""
    target = all_reduce_max_int(len(micros), device)
    if not micros:
        raise ValueError("a worker received an empty batch; the caller must give every rank at least one sample")
    return [(m, False) for m in micros] + [(micros[0], True)] * (target - len(micros))


# ------------------------------------------------------------------------------------------------
# Vision-tower dummy


@dataclass(frozen=True)
class DummyImage:
    """The smallest image the vision tower takes: one (1, m, m) grid = m*m patches = 1 image token."""

    image_token_id: int
    pixel_values: Tensor  # (m*m, C * temporal_patch * patch * patch)
    image_grid_thw: Tensor  # (1, 3)


def dummy_image_for(hf_config: Any) -> DummyImage | None:
    """A DummyImage for Qwen2-VL / Qwen2.5-VL configs, None for text-only models."""
    vision = getattr(hf_config, "vision_config", None)
    image_token_id = getattr(hf_config, "image_token_id", None)
    if vision is None or image_token_id is None:
        return None
    m = vision.spatial_merge_size
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
    dim = channels * vision.temporal_patch_size * vision.patch_size**2
    return DummyImage(
        image_token_id=int(image_token_id),
        pixel_values=torch.zeros(m * m, dim),
        image_grid_thw=torch.tensor([[1, m, m]]),
    )


def has_images(batch: Batch) -> bool:
    items = batch.get(MULTI_MODAL_KEY) or []
    return any(item and item.get("pixel_values") is not None for item in items)


def check_no_videos(batch: Batch) -> None:
    items = batch.get(MULTI_MODAL_KEY) or []
    for i, item in enumerate(items):
        if item and item.get("pixel_values_videos") is not None:
            raise NotImplementedError(
                f"sample {i} has video inputs (pixel_values_videos); the FSDP workers train on images only for now"
            )


def with_dummy_image(batch: Batch, dummy: DummyImage) -> Batch:
    """``batch`` plus one extra row holding a single image token (left padded), so that the vision
    tower runs. The caller drops the extra row's outputs; it attends only to itself."""
    B, L = batch["input_ids"].shape
    tensors = {}
    for key in ("input_ids", "attention_mask", "position_ids", "responses"):
        value = batch[key]
        extra = torch.zeros((1,) + tuple(value.shape[1:]), dtype=value.dtype, device=value.device)
        tensors[key] = torch.cat([value, extra], dim=0)
    tensors["input_ids"][B, L - 1] = dummy.image_token_id
    # attended: the image token; the row's only other attended token would be "predecessor" of
    # response positions, so the extra row never has a valid response position
    tensors["attention_mask"][B, L - 1] = True
    items = list(batch.get(MULTI_MODAL_KEY) or [{}] * B)
    items.append({"pixel_values": dummy.pixel_values, "image_grid_thw": dummy.image_grid_thw})
    return Batch(tensors, {MULTI_MODAL_KEY: items})


# ------------------------------------------------------------------------------------------------
# Optimizer step


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float, nonfinite_loss: bool
) -> tuple[float, bool]:
    """Clip gradients to ``max_grad_norm`` and step, unless the loss (on any rank) or the global
    gradient norm is not finite. Returns (grad_norm, stepped); gradients are zeroed either way."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    stepped = not nonfinite_loss and bool(np.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


# ------------------------------------------------------------------------------------------------
# Checkpoints: model + optimizer sharded with torch.distributed.checkpoint, the rest per rank


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_state()}, path / f"extra_state_rank{rank}.pt")
    if world_size() > 1:
        dist.barrier()


def load_sharded_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> None:
    """Inverse of :func:`save_sharded_checkpoint` (same world size). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    extra_file = path / f"extra_state_rank{rank}.pt"
    if not (path / "model_optim").is_dir() or not extra_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a worker checkpoint of this world size (needs model_optim/ and {extra_file.name})"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path / "model_optim"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(extra_file, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])


def token_budget(role_config: Any, micro_batch_size: int, batch: Batch) -> int | None:
    """Dynamic batching's attended-token budget per micro-batch, None when it is off.

    ``max_token_len_per_device`` if the role config has one, else ``micro_batch_size`` full-length
    rows of this batch (so a budget micro-batch never exceeds the fixed-size one's padded size).
    """
    if not getattr(role_config, "dynamic_batching", False):
        return None
    explicit = getattr(role_config, "max_token_len_per_device", None)
    return int(explicit) if explicit else micro_batch_size * batch["input_ids"].shape[1]
