"""Padding-free (packed) forward passes: B padded sequences become one row of N valid tokens.
``VARLEN_ATTENTION`` attends within the row's segments without a 2-D mask and is transformers'
SDPA with one, so one model serves both. docs/workers.md, "Padding-free forward"."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from easyvlm.models.flex_packed import flex_available, flex_packed_attention
from easyvlm.models.segments import Segment, packed_segments
from easyvlm.models.ulysses import UlyssesAttention, heads_to_sequence, sequence_to_heads

VARLEN_ATTENTION = "easyvlm_varlen"

KERNEL_KWARG = "easyvlm_attention_kernel"
"""The model-forward keyword that forces a packed-attention kernel (one of ``PACKED_KERNELS``);
transformers passes a model's extra keyword arguments down to every attention call."""

PACKED_KERNELS = ("flash_attn", "flex", "sdpa")
"""flash-attn's varlen kernel, torch's flex_attention over the whole row, SDPA once per sequence."""

_registered = False


def register_varlen_attention() -> str:
    """Register ``VARLEN_ATTENTION`` with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
        AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_attention_mask)
        _registered = True
    return VARLEN_ATTENTION


def varlen_attention_mask(*, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """Mask builder for ``VARLEN_ATTENTION``: SDPA's 4-D mask with padding, else None (no (N, N) mask)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Cumulative sequence lengths (S+1,) int32 of packed positions: [0 1 2 0 1 0] -> [0 3 5 6]."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    total = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, total]).to(torch.int32)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    easyvlm_ulysses: UlyssesAttention | None = None,
    easyvlm_attention_kernel: str | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention for ``VARLEN_ATTENTION``: query (1, H, N, D), key/value (1, Hkv, N, D) -> (1, N, H, D). Packed input (no
    mask, text positions): causal per segment, maybe under Ulysses or a forced kernel; else transformers' SDPA as is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed = attention_mask is None and position_ids is not None and query.shape[0] == 1
    causal = getattr(module, "is_causal", True)
    if easyvlm_ulysses is not None:
        if not (packed and causal):
            raise ValueError("Ulysses sequence parallelism runs the packed (padding-free) causal decoder only")
        sp = easyvlm_ulysses.sp
        q, k, v = (sequence_to_heads(t, sp) for t in (query, key, value))
        out = _packed_attention(q, k, v, easyvlm_ulysses.segments, dropout, scaling, easyvlm_attention_kernel)
        return heads_to_sequence(out, sp), None
    if not packed or not causal:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    segments = packed_segments(position_ids)  # a host sync of the segment starts, once per layer
    return _packed_attention(query, key, value, segments, dropout, scaling, easyvlm_attention_kernel), None


def packed_attention_kernel(device: torch.device, *, shared_prompts: bool = False, dropout: float = 0.0) -> str:
    """The packed-attention kernel for ``device`` and what is installed (one of ``PACKED_KERNELS``):
    on CUDA flash-attn (not for shared prompts), then flex_attention (no dropout), then SDPA per
    sequence; on the CPU SDPA per sequence (torch has no CPU backward for eager flex_attention)."""
    if device.type != "cuda":
        return "sdpa"
    if not shared_prompts and _flash_attn_available():
        return "flash_attn"
    if dropout == 0.0 and flex_available(device):
        return "flex"
    return "sdpa"


def _packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: list[Segment],
    dropout: float,
    scaling: float | None,
    kernel: str | None = None,
) -> Tensor:
    """Causal attention within the segments of a packed row. query (1, H, N, D), key/value
    (1, Hkv, N, D) -> (1, N, H, D). ``kernel``: one of ``PACKED_KERNELS``, or None to pick."""
    shared = any(segment.prefix for segment in segments)
    if kernel is None:
        kernel = packed_attention_kernel(query.device, shared_prompts=shared, dropout=dropout)
    elif kernel not in PACKED_KERNELS:
        raise ValueError(f"{KERNEL_KWARG}={kernel!r}: choose one of {PACKED_KERNELS}")
    if kernel == "flex":
        return flex_packed_attention(query, key, value, segments, dropout, scaling)
    if kernel == "flash_attn" and shared:
        raise ValueError("flash-attn's varlen kernel cannot run shared-prompt branches; use 'flex' or 'sdpa'")
    if shared:
        # SDPA per trunk and per run of equal-length branches
        return _shared_prefix_attention(query, key, value, segments, dropout, scaling)
    lengths = [segment.length for segment in segments]
    if kernel == "flash_attn":
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=query.device)
        return _flash_varlen(query, key, value, cu_seqlens, dropout, scaling)
    gqa = query.shape[1] != key.shape[1]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _shared_prefix_attention(
    query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], dropout: float, scaling: float | None
) -> Tensor:
    """Causal attention over trunks and branches (see :func:`packed_segments`), same shapes as
    :func:`_packed_attention`; branches of one trunk with equal length and prefix run as one SDPA
    call. The row is split once, not sliced per run: a slice's backward fills a whole-row zero tensor."""
    gqa = query.shape[1] != key.shape[1]
    runs = _segment_runs(segments)
    sizes = [count * segments[first].length for first, count in runs]
    if sum(sizes) != query.shape[2]:
        raise ValueError(f"the segments cover {sum(sizes)} of the row's {query.shape[2]} tokens")
    q_runs, k_runs, v_runs = (t.split(sizes, dim=2) for t in (query, key, value))
    trunk_index = {segments[first].start: r for r, (first, _) in enumerate(runs) if not segments[first].prefix}
    outputs: list[Tensor] = []  # (1, H, n, D) chunks in row order
    for r, (first, g) in enumerate(runs):
        seg = segments[first]
        if not seg.prefix:
            outputs.append(F.scaled_dot_product_attention(
                q_runs[r], k_runs[r], v_runs[r], dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa))
            continue
        n, s, trunk = seg.length, seg.prefix, trunk_index[seg.trunk_start]

        def branches(t: Tensor) -> Tensor:  # (1, h, g * n, D) -> (g, h, n, D)
            return t[0].unflatten(1, (g, n)).transpose(0, 1)

        def with_prefix(t: Tensor, trunk_t: Tensor) -> Tensor:  # (g, h, s + n, D): the trunk's first s tokens, then the branch
            return torch.cat([trunk_t[:, :, :s].expand(g, -1, -1, -1), branches(t)], dim=2)

        # branch token r sees every prefix token and its own tokens 0..r
        allowed = torch.ones(n, s + n, dtype=torch.bool, device=query.device)
        allowed[:, s:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        out = F.scaled_dot_product_attention(
            branches(q_runs[r]), with_prefix(k_runs[r], k_runs[trunk]), with_prefix(v_runs[r], v_runs[trunk]),
            attn_mask=allowed, dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        )  # (g, H, n, D)
        outputs.append(out.transpose(0, 1).flatten(1, 2).unsqueeze(0))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _segment_runs(segments: list[Segment]) -> list[tuple[int, int]]:
    """(first segment, count) of each run in row order: a trunk alone, or consecutive branches of one
    trunk with the same length and prefix (stored back to back, so a run is one block of rows)."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(segments):
        seg, j = segments[i], i + 1
        if seg.prefix:
            while j < len(segments) and (segments[j].prefix, segments[j].trunk_start, segments[j].length) == (
                seg.prefix, seg.trunk_start, seg.length
            ):
                j += 1
        runs.append((i, j - i))
        i = j
    return runs


def _flash_attn_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def _flash_varlen(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, dropout: float, scaling: float | None):
    """flash-attn's varlen kernel (CUDA only; fp16/bf16 inputs). Untested on the CPU machine."""
    from flash_attn import flash_attn_varlen_func

    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    out = flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True
    )
    return out.unsqueeze(0)  # (1, N, H, D)


# ------------------------------------------------------------------------------------------------
# Packing


@dataclass
class PackedInputs:
    """One row of valid tokens. ``input_ids`` (1, N); ``position_ids`` (1, N) or (4, 1, N) for
    mRoPE; ``token_index`` (N,) the flat index ``b * L + j`` of each packed token in the padded
    (B, L) batch; ``padded_to_packed`` (B, L) int64, the packed index of each padded token or -1."""

    input_ids: Tensor
    position_ids: Tensor
    token_index: Tensor
    padded_to_packed: Tensor


def pack_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    *,
    prompt_length: int = 0,
    prompt_source: Tensor | None = None,
) -> PackedInputs:
    """Remove padding. input_ids/attention_mask (B, L); position_ids (B, L) or (B, R, L), R = 3 or 4. Each
    sequence's valid tokens must be one run from text position 0, else ValueError. ``prompt_source`` (B,): the row
    whose identical prompt (columns ``0 .. prompt_length - 1``) each row reuses (itself if packed whole); a reusing
    row, right after its source, adds only its response, its prompt mapped to the source's in ``padded_to_packed``."""
    mask = attention_mask.bool()
    B, L = mask.shape
    lengths = mask.sum(-1)  # (B,)
    if bool((lengths == 0).any()):
        empty = torch.nonzero(lengths == 0).reshape(-1).tolist()
        raise ValueError(f"pack_inputs: sequences {empty} have no attended token (attention_mask all False)")
    rows = torch.arange(B, device=mask.device)
    keep = mask
    followers = None
    if prompt_source is not None:
        prompt_source = prompt_source.to(mask.device)
        followers = prompt_source != rows
        # a follower's tokens must land right after its prompt's trunk: its source is its predecessor's
        grouped = torch.ones_like(followers)
        grouped[1:] = prompt_source[1:] == prompt_source[:-1]
        if bool((followers & ~grouped).any()):
            bad = torch.nonzero(followers & ~grouped).reshape(-1).tolist()
            raise ValueError(f"pack_inputs: rows {bad} reuse a prompt that is not their predecessor's (or its source)")
        keep = mask.clone()
        keep[followers, :prompt_length] = False
    token_index = torch.nonzero(keep.reshape(-1)).reshape(-1)  # (N,)
    N = token_index.numel()
    padded_to_packed = torch.full((B * L,), -1, dtype=torch.long, device=mask.device)
    padded_to_packed[token_index] = torch.arange(N, device=mask.device)
    padded_to_packed = padded_to_packed.view(B, L)
    if followers is not None and bool(followers.any()):
        sources = prompt_source[followers]
        padded_to_packed[followers, :prompt_length] = padded_to_packed[sources, :prompt_length]

    # text positions 0..len-1 per sequence (a follower's response continues after its prompt)
    text_positions = (mask.long().cumsum(-1) - 1).reshape(-1)[token_index]  # (N,)

    if position_ids.dim() == 2:
        packed_positions = position_ids.reshape(-1)[token_index]
        if not torch.equal(packed_positions, text_positions):
            raise ValueError(
                "pack_inputs: position_ids of the attended tokens must be 0, 1, ... per sequence "
                "(cumsum of attention_mask - 1); other layouts cannot be packed"
            )
        packed_position_ids = packed_positions.unsqueeze(0)  # (1, N)
    elif position_ids.dim() == 3 and position_ids.shape[1] in (3, 4):
        mrope = position_ids[:, -3:, :].permute(1, 0, 2).reshape(3, B * L)[:, token_index]  # (3, N)
        packed_position_ids = torch.cat([text_positions.unsqueeze(0), mrope], dim=0).unsqueeze(1)  # (4, 1, N)
    else:
        raise ValueError(f"pack_inputs: position_ids must be (B, L) or (B, 3|4, L), got {tuple(position_ids.shape)}")
    return PackedInputs(
        input_ids=input_ids.reshape(-1)[token_index].unsqueeze(0),
        position_ids=packed_position_ids,
        token_index=token_index,
        padded_to_packed=padded_to_packed,
    )
