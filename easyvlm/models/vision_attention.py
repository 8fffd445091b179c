"""The Qwen-VL vision towers' windowed attention as one SDPA call per window length, not per window
(transformers' SDPA path); not ``AttentionInterface``, which is called after the split. docs/workers.md,
"Padding-free forward"."""

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
    yields them) with each group's row indices on ``device``. Reads ``cu_seqlens`` on the host."""
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
    """A memo of window plans shared by one model's vision attention modules: the tower's layers get
    the same ``cu_seqlens`` tensor, so one host sync per tensor. A plan is served only for the very
    tensor (weak reference) at the same version (inference-mode tensors: rebuilt every call)."""

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
    """A vision block's attention with transformers' call signature: ``qkv``, rotary embedding,
    attention within each window of ``cu_seqlens`` (equal lengths batched), ``proj``."""

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
    """Non-causal attention of each window ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` to itself
    (windows as ``cu_seqlens`` or its plan). query, key, value (N, H, D) -> (N, H, D)."""
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
    """Replace every SDPA vision attention module of ``model`` (not flash or eager, asked for on purpose) by a
    :class:`WindowBatchedVisionAttention` sharing one :class:`WindowPlans`; returns how many."""
    replaced, plans = 0, WindowPlans()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ not in REPLACED_CLASSES or child.config._attn_implementation != "sdpa":
                continue
            rotate = getattr(sys.modules[type(child).__module__], "apply_rotary_pos_emb_vision")
            setattr(parent, name, WindowBatchedVisionAttention(child, rotate, plans))
            replaced += 1
    return replaced
