"""Batched packed attention from torch itself: ``flex_attention`` over the whole packed row, with a
``BlockMask`` built from the row's segments (``easyvlm.models.segments``).

Why flex_attention and not ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10 has both):
varlen_attn is flash-attn's kernel inside torch, CUDA only (no CPU implementation, so nothing of it
could be checked on the CPU), without dropout, and one (q, k) pair of ``cu_seqlens`` cannot express a
shared-prompt branch (its keys are the trunk's first tokens *and* its own, not one contiguous run).
flex_attention takes any mask: a token attends causally within its segment and, in a branch, to
the first ``prefix`` tokens of its trunk; GQA (``enable_gqa``) and the scale are arguments.

The mask, for query token q and key token k of the packed row (one row of N tokens)::

    allowed(q, k) = own_start[q] <= k <= q  or  prefix_lo[q] <= k < prefix_hi[q]

``own_start`` is the first token of q's segment; ``[prefix_lo, prefix_hi)`` is its trunk's first
``prefix`` tokens for a branch, empty for a trunk. :func:`segment_block_mask` builds the BlockMask
from these intervals per (token, key block), O(N * N / block) memory, instead of evaluating the mask
on all N x N pairs as ``create_block_mask`` does (tests check the two agree block for block).

Speed needs ``torch.compile``: eager flex_attention is torch's dense reference (it materialises the
H x N x N scores). On CUDA the kernel is ``torch.compile(flex_attention)`` (Triton), as transformers
does, compiled once with dynamic shapes (:func:`compile_flex`: packed rows differ in length every
micro-batch); on the CPU it runs eagerly (forward only: torch refuses flex_attention's backward on
the CPU) and is never chosen by default there (per-sequence SDPA is faster; bench/packed_attention.py).
No attention dropout: :func:`flex_packed_attention` refuses ``dropout != 0`` (the selection in
``easyvlm.models.padding_free`` then keeps per-sequence SDPA).
"""

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
    """Whether this torch can run the batched kernel fast on ``device``: flex_attention exists, and
    on CUDA Triton is installed (torch.compile's GPU backend; without it flex runs densely)."""
    import importlib.util

    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False
    if device.type != "cuda":
        return True
    from torch.utils._triton import has_triton

    return has_triton()


def token_intervals(segments: list[Segment], n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(own_start, prefix_lo, prefix_hi), each (n,) int32: the keys token q attends to are
    ``own_start[q] .. q`` and ``prefix_lo[q] .. prefix_hi[q] - 1`` (empty for a trunk's tokens)."""
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
    """The BlockMask (batch 1, heads broadcast) of the packed row: trunks causal on themselves,
    branches on their trunk's prefix and causally on themselves (see the module docstring).

    A (query block, key block) pair is *full* when every token of the query block may see every key
    of the key block (the kernel skips the mask there), *partial* when some may (the mask decides per
    pair), and skipped otherwise. Blocks cut by the row's end are never full (as torch's own builder).
    """
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
    """``torch.compile(flex_attention)`` with the row length dynamic from the first call, so it
    compiles once, not static first and again with dynamic shapes at the first new length (torch's
    default, "automatic dynamic"). Heads and head size are fixed per model and stay static: were they
    dynamic, a first row whose block count equals a head count would be specialised with it (equal
    sizes share one symbol) and compiled again at the next length."""
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
    """The kernel CUDA runs, built once per process."""
    return compile_flex()


_last_mask: tuple[tuple, BlockMask] | None = None


def _cached_block_mask(segments: list[Segment], n: int, device: torch.device) -> BlockMask:
    """The row's BlockMask, rebuilt only when the segments change: every decoder layer (and the
    recomputation under gradient checkpointing) of one forward reuses it."""
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
