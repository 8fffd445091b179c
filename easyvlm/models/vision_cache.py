"""Each image through a frozen vision tower once: embeddings kept on the device by pixel hash, given to the
model as ``mm_encoder_outputs`` by a pre-hook after FSDP's; each image is encoded alone, so the result is
bitwise a per-image forward. docs/workers.md, "Each image through a frozen tower once"."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from easyvlm.models.loading import get_vision_tower

logger = logging.getLogger(__name__)

MiB = 2**20

# the model's inputs of each modality: (pixels, grid) -> mm_encoder_outputs[modality]
MODALITIES = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}

try:  # 26 GB/s against blake2b's 0.8 GB/s on a Xeon core (4.6 MiB of pixels: 0.18 ms, 6.2 ms)
    import xxhash

    def _digest(data: memoryview) -> bytes:
        return xxhash.xxh3_128_digest(data)
except ImportError:  # pragma: no cover - xxhash is a dependency; a bare machine still runs
    def _digest(data: memoryview) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()


def pixel_keys(pixels: Tensor, grid_thw: Tensor, modality: str = "image") -> list[bytes]:
    """One key per image (or video) of a forward's inputs: pixels (N, D) on the host, grid_thw (n, 3). The key
    hashes the image's rows, grid, dtype and modality: equal keys, equal inputs to the same encoder."""
    pixels = pixels.detach().cpu().contiguous()
    keys, start = [], 0
    for t, h, w in grid_thw.tolist():
        rows = pixels[start : start + t * h * w]
        start += t * h * w
        raw = rows.view(torch.uint8)  # the bytes (numpy has no bfloat16)
        header = f"{modality}:{t},{h},{w},{rows.shape[-1]},{rows.dtype}".encode()
        keys.append(header + _digest(memoryview(raw.numpy()).cast("B")))
    return keys


@dataclass
class Encoded:
    """One image's tower outputs: merged embeddings (tokens, hidden), and per deepstack layer one more (Qwen3-VL)."""

    embeds: Tensor
    deepstack: tuple[Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


class VisionEmbeddingCache:
    """Encoded images by key, least recently used evicted beyond ``budget_mb`` MiB (one image larger
    than the budget is still used by the forward that encoded it, just not kept)."""

    def __init__(self, budget_mb: int):
        if budget_mb <= 0:
            raise ValueError(f"a vision cache needs a budget > 0 MiB, got {budget_mb}")
        self.budget = budget_mb * MiB
        self.entries: OrderedDict[bytes, Encoded] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, key: bytes) -> Optional[Encoded]:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Encoded) -> None:
        if key in self.entries:
            self.nbytes -= self.entries.pop(key).nbytes
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget and self.entries:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        """Drop every entry (the worker gives its device memory back: ``offload``)."""
        self.entries.clear()
        self.nbytes = 0

    def take_counts(self) -> tuple[int, int]:
        """(hits, misses) since the last call; resets them."""
        counts = (self.hits, self.misses)
        self.hits = self.misses = 0
        return counts


class PendingVision:
    """A forward's images, not yet encoded: per modality its pixels and grids (host) and their keys,
    passed as ``mm_encoder_outputs``. A plain class so FSDP's input-to-device pass leaves it alone."""

    def __init__(self, inputs: dict[str, Tensor]):
        self.parts: dict[str, tuple[list[bytes], Tensor, Tensor]] = {}
        for modality, (pixels_key, grid_key) in MODALITIES.items():
            if pixels_key in inputs:
                pixels, grid = inputs[pixels_key], inputs[grid_key]
                self.parts[modality] = (pixel_keys(pixels, grid, modality), pixels, grid)


def model_inputs_with_cache(inputs: dict[str, Tensor], device: torch.device) -> dict[str, Any]:
    """The model's vision inputs with the pixels behind a :class:`PendingVision` as
    ``mm_encoder_outputs`` (transformers refuses it next to ``pixel_values*``)."""
    pixel_names = {pixels for pixels, _ in MODALITIES.values()}
    out: dict[str, Any] = {k: v.to(device) for k, v in inputs.items() if k not in pixel_names}
    if any(name in inputs for name in pixel_names):
        out["mm_encoder_outputs"] = PendingVision(inputs)
    return out


def encode_pending(model: nn.Module, pending: PendingVision, cache: VisionEmbeddingCache, device: torch.device) -> dict[str, Any]:
    """``mm_encoder_outputs`` of ``pending``: each image from ``cache``, else encoded alone (no grad) and stored."""
    outputs: dict[str, Any] = {}
    for modality, (keys, pixels, grid) in pending.parts.items():
        encode = getattr(model, f"get_{modality}_features")
        entries, output_type, start = [], None, 0
        for key, (t, h, w), thw in zip(keys, grid.tolist(), grid):
            rows = slice(start, start + t * h * w)
            start += t * h * w
            entry = cache.get(key)
            if entry is None:
                with torch.no_grad():
                    out = encode(pixels[rows].to(device), thw[None].to(device), return_dict=True)
                output_type = type(out)
                # one image's outputs, joined (a family may split a video's by frame)
                deepstack = tuple(torch.cat(feature) for feature in getattr(out, "deepstack_features", None) or ())
                entry = Encoded(torch.cat(out.pooler_output), deepstack)
                cache.put(key, entry)
            entries.append(entry)
        outputs[modality] = _encoder_output(entries, output_type)
    return outputs


def _encoder_output(entries: list[Encoded], output_type: Optional[type]) -> Any:
    """The per-image outputs in ``get_*_features``' layout: ``pooler_output`` a tuple of (tokens,
    hidden) tensors; Qwen3-VL's ``deepstack_features`` a list over layers of such tuples."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    embeds = tuple(entry.embeds for entry in entries)
    layers = len(entries[0].deepstack)
    if not layers:
        return BaseModelOutputWithPooling(pooler_output=embeds)
    if output_type is None:  # every image was cached: the family's class by its module
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures as output_type
    deepstack = [tuple(entry.deepstack[layer] for entry in entries) for layer in range(layers)]
    return output_type(pooler_output=embeds, deepstack_features=deepstack)


def install_vision_cache(model: nn.Module, cache: VisionEmbeddingCache, device: torch.device) -> RemovableHandle:
    """Let ``model`` take :class:`PendingVision` inputs: a forward pre-hook, registered after FSDP's,
    that encodes them through ``cache``. Refuses a model whose vision tower trains."""
    tower = get_vision_tower(model)
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower to cache")
    if any(p.requires_grad for p in tower.parameters()):
        raise ValueError("the vision cache needs a frozen vision tower (model.freeze_vision_tower=true)")

    def resolve(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pending = kwargs.get("mm_encoder_outputs")
        if isinstance(pending, PendingVision):
            kwargs = {**kwargs, "mm_encoder_outputs": encode_pending(module, pending, cache, device)}
        return args, kwargs

    return model.register_forward_pre_hook(resolve, with_kwargs=True)


class CachedTower:
    """A worker's cache and the hook that serves its model from it."""

    def __init__(self, model: nn.Module, budget_mb: int, device: torch.device):
        self.model, self.device = model, device
        self.cache = VisionEmbeddingCache(budget_mb)
        self._hook = install_vision_cache(model, self.cache, device)

    def share(self, other: "CachedTower") -> None:
        """Serve this model from ``other``'s entries (a tower :func:`same_frozen_tower` found equal)."""
        self._hook.remove()
        self.cache = other.cache
        self._hook = install_vision_cache(self.model, self.cache, self.device)


def same_frozen_tower(model_a: nn.Module, compute_dtype_a: Optional[torch.dtype],
                      model_b: nn.Module, compute_dtype_b: Optional[torch.dtype]) -> bool:
    """Whether two models' vision towers compute alike on this rank, from the tensors (not the config): same names,
    values bitwise equal shard by shard in each model's FSDP compute dtype (None = the parameter's own)."""
    tower_a, tower_b = get_vision_tower(model_a), get_vision_tower(model_b)
    if tower_a is None or tower_b is None:
        return False

    def tensors(tower: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, Tensor]:
        out = {name: t.to_local() if hasattr(t, "to_local") else t for name, t in tower.named_buffers()}
        for name, t in tower.named_parameters():
            local = (t.to_local() if hasattr(t, "to_local") else t).detach()
            out[name] = local.to(dtype) if dtype is not None and local.is_floating_point() else local
        return out

    a, b = tensors(tower_a, compute_dtype_a), tensors(tower_b, compute_dtype_b)
    return a.keys() == b.keys() and all(
        a[name].dtype == b[name].dtype and a[name].shape == b[name].shape and torch.equal(a[name], b[name]) for name in a
    )
