"""Padding-free (packed) forward passes: B padded sequences become one row of N valid tokens.

A padded batch (B, L) spends attention and MLP work on pad tokens; RL batches are very ragged
(prompts are left padded, responses right padded), so packing saves most of it.

How it works, through transformers' extension points (no monkey patch):

- ``pack_inputs`` keeps the tokens where ``attention_mask`` is True, in sample order, as one row
  (1, N). Its position ids restart at 0 at each sequence start. For mRoPE models (Qwen2-VL,
  Qwen2.5-VL) it builds transformers' 4-row layout (4, 1, N): row 0 holds the per-sequence text
  positions (transformers uses that row only to find sequence boundaries), rows 1-3 the mRoPE
  (temporal, height, width) positions taken from the padded batch.
- ``VARLEN_ATTENTION`` ("easyvlm_varlen") is registered with ``AttentionInterface`` and
  ``AttentionMaskInterface``; a model loaded with ``attn_implementation=VARLEN_ATTENTION`` (for its
  text decoder) runs both layouts:
  * packed (no 2-D attention mask): a new sequence starts wherever the text position is 0; each
    sequence attends causally to itself only. On CUDA with flash-attn installed this is
    ``flash_attn_varlen_func``; otherwise SDPA per sequence (CPU, or GPU without flash-attn).
  * padded (a 2-D attention mask): exactly transformers' SDPA path, so one loaded model serves both.

The image features do not care about packing: the vision tower sees the same ``pixel_values`` and
``image_grid_thw`` (concatenated in sample order), and its outputs fill the image-pad tokens of
the packed row in the same order as in the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN_ATTENTION = "easyvlm_varlen"

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
    """Mask builder for ``VARLEN_ATTENTION``: SDPA's 4-D mask when there is padding, else none.

    Without a 2-D mask the input is packed (or unpadded): the attention function finds the
    sequence boundaries itself, so no (N, N) block-diagonal mask is ever built.
    """
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Cumulative sequence lengths (S+1,) int32 of a packed row whose positions restart at 0.

    position_ids: (1, N) or (N,). Example: [0 1 2 0 1 0] -> [0 3 5 6].
    """
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
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention for ``VARLEN_ATTENTION``. query (1, H, N, D), key/value (1, Hkv, N, D) -> (1, N, H, D).

    Packed input (no mask, one row, text position ids given): causal attention within each
    sequence. Anything else (a padded batch with its mask, the vision tower's non-causal blocks)
    goes to transformers' SDPA function unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed = attention_mask is None and position_ids is not None and query.shape[0] == 1
    if not packed or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    if query.is_cuda and _flash_attn_available():
        return _flash_varlen(query, key, value, cu_seqlens, dropout, scaling), None
    # note: .tolist() is a host sync; fine on the CPU, and on GPUs flash-attn takes the branch above
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    gqa = query.shape[1] != key.shape[1]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


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


def pack_inputs(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> PackedInputs:
    """Remove padding. input_ids/attention_mask (B, L); position_ids (B, L) or (B, R, L), R = 3 or 4.

    For R = 4 the first row (text positions) is rebuilt; rows R-3 .. R-1 are the mRoPE rows.
    Each sequence's valid tokens must form one run that starts at text position 0 (left-padded
    prompt + right-padded response does); a sequence with no valid token is an error.
    """
    mask = attention_mask.bool()
    B, L = mask.shape
    lengths = mask.sum(-1)  # (B,)
    if bool((lengths == 0).any()):
        empty = torch.nonzero(lengths == 0).reshape(-1).tolist()
        raise ValueError(f"pack_inputs: sequences {empty} have no attended token (attention_mask all False)")
    token_index = torch.nonzero(mask.reshape(-1)).reshape(-1)  # (N,)
    N = token_index.numel()
    padded_to_packed = torch.full((B * L,), -1, dtype=torch.long, device=mask.device)
    padded_to_packed[token_index] = torch.arange(N, device=mask.device)
    padded_to_packed = padded_to_packed.view(B, L)

    # text positions 0..len-1 per sequence: arange minus the packed offset of the sequence start
    offsets = torch.cumsum(lengths, 0) - lengths  # (B,)
    seq_of_token = torch.repeat_interleave(torch.arange(B, device=mask.device), lengths)  # (N,)
    text_positions = torch.arange(N, device=mask.device) - offsets[seq_of_token]  # (N,)

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
