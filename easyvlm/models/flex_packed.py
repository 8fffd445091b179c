"""Packed attention as one ``flex_attention`` call per row, with a ``BlockMask`` from its segments (a branch
sees its trunk's prefix). Fast only compiled (CUDA); on the CPU eager and forward only, never the default.
docs/workers.md, "Padding-free forward"."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from easyvlm.models.segments import Segment

FLEX_BLOCK_SIZE = 128
"""flex_attention's default sparse block (tokens per query block and per key block)."""


def flex_available(device: torch.device) -> bool:
    """Whether flex_attention can run fast on ``device``: it exists, and on CUDA Triton is installed."""
    import importlib.util

    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False
    if device.type != "cuda":
        return True
    from torch.utils._triton import has_triton

    return has_triton()


def token_intervals(segments: list[Segment], n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(own_start, prefix_lo, prefix_hi), each (n,) int32: token q sees keys ``own_start[q] .. q``
    and ``prefix_lo[q] .. prefix_hi[q] - 1``."""
    if sum(seg.length for seg in segments) != n or (segments and segments[0].start != 0):
        raise ValueError(f"the segments cover {sum(s.length for s in segments)} tokens, the row has {n}")
    lengths = torch.tensor([seg.length for seg in segments], device=device)
    table = torch.tensor(
        [[seg.start, seg.trunk_start if seg.prefix else 0, seg.trunk_start + seg.prefix if seg.prefix else 0]
         for seg in segments],
        dtype=torch.int32, device=device,
    )  # (S, 3)
    # three tensors of their own (contiguous, no common base): views of one (3, n) tensor would show the
    # compiled kernel a size 3, which dynamic shapes would tie to a row's block count that happens to be 3
    own_start, prefix_lo, prefix_hi = (column.repeat_interleave(lengths, output_size=n) for column in table.T)
    return own_start, prefix_lo, prefix_hi


def segment_block_mask(
    segments: list[Segment], n: int, device: torch.device, block_size: int = FLEX_BLOCK_SIZE
) -> BlockMask:
    """The BlockMask (batch 1, heads broadcast) of the packed row, from per-token key intervals in
    O(N * N / block) memory. Blocks cut by the row's end are never full (as ``create_block_mask``)."""
    from torch.nn.attention.flex_attention import BlockMask

    own_start, prefix_lo, prefix_hi = token_intervals(segments, n, device)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        own = (kv >= own_start[q]) & (kv <= q)
        return own | ((kv >= prefix_lo[q]) & (kv < prefix_hi[q]))

    n_blocks = -(-n // block_size)
    c0 = torch.arange(n_blocks, device=device, dtype=torch.int32) * block_size  # (K,) first key of each block
    c1 = (c0 + block_size).clamp(max=n)  # one past its last key
    a, lo, hi = (t[:, None] for t in (own_start, prefix_lo, prefix_hi))  # (n, 1)
    e = torch.arange(1, n + 1, device=device, dtype=torch.int32)[:, None]  # own keys a .. e - 1
    has_prefix = lo < hi
    some = ((a < c1) & (e > c0)) | (has_prefix & (lo < c1) & (hi > c0))  # (n, K): the row sees a key of the block
    every = ((a <= c0) & (e >= c1)) | (has_prefix & (lo <= c0) & (hi >= c1))
    every |= has_prefix & (lo <= c0) & (hi >= a) & (e >= c1)  # prefix and own keys touch: one interval
    every &= (c1 - c0) == block_size

    def per_block(rows: Tensor, reduce: Callable[..., Tensor]) -> Tensor:  # (n, K) -> (Q, K)
        padded = torch.zeros(n_blocks * block_size, n_blocks, dtype=torch.bool, device=device)
        padded[:n] = rows  # rows past the end count as "sees nothing": such a block is never full
        return reduce(padded.view(n_blocks, block_size, n_blocks), dim=1)

    full = per_block(every, torch.all)
    partial = per_block(some, torch.any) & ~full

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:  # (Q, K) -> counts (1, 1, Q), indices (1, 1, Q, K)
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def compile_flex(backend: str | Callable = "inductor") -> Callable[..., Tensor]:
    """``torch.compile(flex_attention)`` with the row length dynamic from the first call (one compile);
    heads and head size static, lest a head count equal to a block count share its symbol."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, backend=backend, dynamic=True)

    def attend(query: Tensor, key: Tensor, value: Tensor, **kwargs) -> Tensor:
        for tensor in (query, key, value):  # (1, heads, N, head size)
            torch._dynamo.mark_static(tensor, 1)
            torch._dynamo.mark_static(tensor, 3)
        return compiled(query, key, value, **kwargs)

    return attend


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Callable[..., Tensor]:
    return compile_flex()


_last_mask: tuple[tuple, BlockMask] | None = None


def _cached_block_mask(segments: list[Segment], n: int, device: torch.device) -> BlockMask:
    """The row's BlockMask, rebuilt only when the segments change (all layers of a forward share it)."""
    global _last_mask
    key = (tuple(segments), n, device)
    if _last_mask is None or _last_mask[0] != key:
        _last_mask = (key, segment_block_mask(segments, n, device))
    return _last_mask[1]


def flex_packed_attention(
    query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], dropout: float, scaling: float | None
) -> Tensor:
    """Causal attention within the segments of a packed row (trunks and shared-prompt branches), one
    flex_attention call. query (1, H, N, D), key/value (1, Hkv, N, D) -> (1, N, H, D)."""
    if dropout != 0.0:
        raise ValueError(
            f"flex_attention has no attention dropout (got {dropout}); the per-sequence SDPA kernel has"
        )
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _cached_block_mask(segments, query.shape[2], query.device)
    compiled = query.is_cuda and not torch.compiler.is_compiling()  # inside a compiled model: traced there
    attend = _compiled_flex() if compiled else flex_attention
    out = attend(
        query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous()
