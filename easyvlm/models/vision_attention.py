"""The Qwen-VL vision towers' windowed attention as a few batched SDPA calls, not one per window.

transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision attention hands the windows' boundaries
(``cu_seqlens``) only to flash attention; with SDPA it splits the patches and calls SDPA once per
window (Qwen2.5-VL: 16 windows per 448 x 448 image in 28 of its 32 layers, one per image in the
other 4). On an H200 with Qwen2.5-VL-3B's shapes that was 16,464 attention calls per update of 128
samples, and the chip waited for the host two thirds of the update (docs/benchmarks.md, "A
real-size step on one GPU").

:class:`WindowBatchedVisionAttention` takes the place of each vision block's attention module. It
keeps the original's ``qkv`` and ``proj`` layers (the same parameters under the same names:
checkpoints, FSDP, LoRA and the weight sync see no difference) and computes what the original
computes, except that all windows of one length form one batch: one SDPA call per distinct window
length per layer (the windows of a Qwen2.5-VL image are 8 x 8 patches except at its right and bottom
edges). Each window still attends only to itself, so the result is the per-window result
(tests/models/test_vision_attention.py compares forward and gradients with transformers' module).

Why a replacement module and not transformers' ``AttentionInterface``: the interface function is
called after the split, once per window; the split happens in the module's forward, only a
"flash" implementation name avoids it, and such a name makes transformers import flash-attn.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# transformers' vision attention classes this module replaces (their forward is the same in all three)
REPLACED_CLASSES = frozenset({"VisionAttention", "Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention"})


class WindowBatchedVisionAttention(nn.Module):
    """A vision block's attention: ``qkv``, rotary position embedding, attention within each window
    of ``cu_seqlens`` (windows of one length batched), ``proj``. Same call signature as transformers'."""

    def __init__(self, original: nn.Module, rotate: Callable[..., tuple[Tensor, Tensor]]):
        super().__init__()
        self.qkv, self.proj = original.qkv, original.proj
        self.num_heads = original.num_heads
        self.scaling = original.scaling
        self.rotate = rotate  # the family's apply_rotary_pos_emb_vision

    def forward(
        self, hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> Tensor:
        n = hidden_states.shape[0]
        query, key, value = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        query, key = self.rotate(query, key, cos, sin)
        out = windowed_attention(query, key, value, cu_seqlens, self.scaling)  # (n, H, D)
        return self.proj(out.reshape(n, -1))


def windowed_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Non-causal attention of each window ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` to itself.
    query, key, value (N, H, D) -> (N, H, D); one SDPA call per distinct window length."""
    n, heads, dim = query.shape
    bounds = cu_seqlens.tolist()  # one sync per layer, as transformers' split
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"the windows cover rows {bounds[0]} .. {bounds[-1] - 1}, the tower has {n} patches")
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    if len(by_length) == 1:  # windows of one length cover the row: a view, no gather
        (length, starts), = by_length.items()
        if len(starts) * length == n:
            return _attend(query, key, value, len(starts), length, scale).reshape(n, heads, dim)
    out = query.new_empty(n, heads, dim)
    for length, starts in by_length.items():
        index = (torch.tensor(starts, device=query.device)[:, None] + torch.arange(length, device=query.device)).reshape(-1)
        q, k, v = (t.index_select(0, index) for t in (query, key, value))
        out = out.index_copy(0, index, _attend(q, k, v, len(starts), length, scale).reshape(-1, heads, dim))
    return out


def _attend(query: Tensor, key: Tensor, value: Tensor, windows: int, length: int, scale: float) -> Tensor:
    """(windows * length, H, D) rows of equal windows -> SDPA over (windows, H, length, D) -> (windows, length, H, D)."""
    q, k, v = (t.reshape(windows, length, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


def batch_vision_windows(model: nn.Module) -> int:
    """Replace every transformers vision attention module of ``model`` that runs SDPA (not flash
    attention, not eager: eager is the reference implementation one asks for on purpose) by a
    :class:`WindowBatchedVisionAttention` over the same layers. Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ not in REPLACED_CLASSES or child.config._attn_implementation != "sdpa":
                continue
            rotate = getattr(sys.modules[type(child).__module__], "apply_rotary_pos_emb_vision")
            setattr(parent, name, WindowBatchedVisionAttention(child, rotate))
            replaced += 1
    return replaced
