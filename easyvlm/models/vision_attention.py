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

The windows' grouping (a :class:`WindowPlan`: lengths, starts and row indices on the device) needs
``cu_seqlens`` on the host, a sync on the GPU. Within one forward the tower passes one tensor to all
its layers of a kind (Qwen2.5-VL: ``cu_window_seqlens`` to its 28 windowed layers, ``cu_seqlens`` to
every eighth, the full-attention ones; Qwen2-VL and Qwen3-VL: ``cu_seqlens`` to all), so the modules
of one model share a :class:`WindowPlans` memo that builds a plan once per distinct tensor: two syncs
per Qwen2.5-VL tower forward, not 32. The memo holds the tensor by weak reference and its version counter, so a new
tensor, or the same one changed in place, gets a new plan (an inference-mode tensor has no version
counter: its plan is rebuilt on every call).

Why a replacement module and not transformers' ``AttentionInterface``: the interface function is
called after the split, once per window; the split happens in the module's forward, only a
"flash" implementation name avoids it, and such a name makes transformers import flash-attn.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# transformers' vision attention classes this module replaces (their forward is the same in all three)
REPLACED_CLASSES = frozenset({"VisionAttention", "Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention"})


class WindowPlan(NamedTuple):
    """The windows of one ``cu_seqlens``, grouped by length."""

    first: int  # cu_seqlens[0] and [-1]: the rows the windows cover
    end: int
    device: torch.device  # where the row indices are
    groups: tuple[tuple[int, int, Tensor | None], ...]
    # per window length: (windows, length, their rows (windows * length,) on the device); the rows are
    # None where windows of one length tile all rows (a view, no gather)


def window_plan(cu_seqlens: Tensor, device: torch.device) -> WindowPlan:
    """Group the windows of ``cu_seqlens`` by length (empty ones skipped, as transformers' split
    yields an empty chunk) and put each group's row indices on ``device``."""
    bounds = cu_seqlens.tolist()  # the host sync
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    if len(by_length) == 1:
        (length, starts), = by_length.items()
        if bounds[0] == 0 and len(starts) * length == bounds[-1]:
            return WindowPlan(bounds[0], bounds[-1], device, ((len(starts), length, None),))
    groups = tuple(
        (len(starts), length,
         (torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)).reshape(-1))
        for length, starts in by_length.items()
    )
    return WindowPlan(bounds[0], bounds[-1], device, groups)


class WindowPlans:
    """The plans of the last few ``cu_seqlens`` tensors seen, one memo shared by the attention modules
    of one model (:func:`batch_vision_windows`): the tower's layers receive the same tensor, so the
    first layer builds its plan and the others reuse it. A plan is served only for the very tensor
    it was built from (a weak reference, alive), at the same version (not changed in place since)."""

    KEEP = 4  # a tower forward uses one or two tensors; the rest are dead or a previous forward's

    def __init__(self) -> None:
        self._entries: list[tuple[weakref.ref, int, WindowPlan]] = []

    def get(self, cu_seqlens: Tensor, device: torch.device) -> WindowPlan:
        if cu_seqlens.is_inference():  # no version counter: an in-place change could not be seen
            return window_plan(cu_seqlens, device)
        for ref, version, plan in self._entries:
            if ref() is cu_seqlens and version == cu_seqlens._version and plan.device == device:
                return plan
        plan = window_plan(cu_seqlens, device)
        alive = [entry for entry in self._entries if entry[0]() is not None]
        self._entries = alive[-(self.KEEP - 1):] + [(weakref.ref(cu_seqlens), cu_seqlens._version, plan)]
        return plan

    def __reduce__(self):  # copies (deepcopy, pickle) start empty: weak references do not travel
        return (type(self), ())


class WindowBatchedVisionAttention(nn.Module):
    """A vision block's attention: ``qkv``, rotary position embedding, attention within each window
    of ``cu_seqlens`` (windows of one length batched), ``proj``. Same call signature as transformers'.
    ``plans`` is the memo of window plans shared with the model's other vision attention modules."""

    def __init__(self, original: nn.Module, rotate: Callable[..., tuple[Tensor, Tensor]], plans: WindowPlans):
        super().__init__()
        self.qkv, self.proj = original.qkv, original.proj
        self.num_heads = original.num_heads
        self.scaling = original.scaling
        self.rotate = rotate  # the family's apply_rotary_pos_emb_vision
        self.plans = plans  # not a module: no parameters, no state_dict entries

    def forward(
        self, hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> Tensor:
        n = hidden_states.shape[0]
        query, key, value = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        query, key = self.rotate(query, key, cos, sin)
        plan = self.plans.get(cu_seqlens, query.device)
        out = windowed_attention(query, key, value, plan, self.scaling)  # (n, H, D)
        return self.proj(out.reshape(n, -1))


def windowed_attention(
    query: Tensor, key: Tensor, value: Tensor, windows: Tensor | WindowPlan, scale: float
) -> Tensor:
    """Non-causal attention of each window ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` to itself, the
    windows given as ``cu_seqlens`` or as its plan. query, key, value (N, H, D) -> (N, H, D); one SDPA
    call per distinct window length."""
    n, heads, dim = query.shape
    plan = window_plan(windows, query.device) if isinstance(windows, Tensor) else windows
    if plan.first != 0 or plan.end != n:
        raise ValueError(f"the windows cover rows {plan.first} .. {plan.end - 1}, the tower has {n} patches")
    if plan.groups and plan.groups[0][2] is None:  # windows of one length tile the rows: a view, no gather
        count, length, _ = plan.groups[0]
        return _attend(query, key, value, count, length, scale).reshape(n, heads, dim)
    out = query.new_empty(n, heads, dim)
    for count, length, index in plan.groups:
        q, k, v = (t.index_select(0, index) for t in (query, key, value))
        out = out.index_copy(0, index, _attend(q, k, v, count, length, scale).reshape(-1, heads, dim))
    return out


def _attend(query: Tensor, key: Tensor, value: Tensor, windows: int, length: int, scale: float) -> Tensor:
    """(windows * length, H, D) rows of equal windows -> SDPA over (windows, H, length, D) -> (windows, length, H, D)."""
    q, k, v = (t.reshape(windows, length, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


def batch_vision_windows(model: nn.Module) -> int:
    """Replace every transformers vision attention module of ``model`` that runs SDPA (not flash
    attention, not eager: eager is the reference implementation one asks for on purpose) by a
    :class:`WindowBatchedVisionAttention` over the same layers, all sharing one :class:`WindowPlans`.
    Returns how many were replaced."""
    replaced, plans = 0, WindowPlans()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ not in REPLACED_CLASSES or child.config._attn_implementation != "sdpa":
                continue
            rotate = getattr(sys.modules[type(child).__module__], "apply_rotary_pos_emb_vision")
            setattr(parent, name, WindowBatchedVisionAttention(child, rotate, plans))
            replaced += 1
    return replaced
