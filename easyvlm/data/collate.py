"""Collation: samples -> a prompt Batch (keys: docs/data.md, "The prompt batch"), and per-sample
vision inputs -> one forward's inputs."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from easyvlm.data.batch import ORIGINAL_IMAGES_KEY, PROMPT_OBJECT_KEYS, Batch


def left_pad(sequences: Sequence[Tensor], pad_value: int) -> Tensor:
    """Stack (..., L_i) tensors into (B, ..., max L_i), padding on the left of the last dim."""
    length = max(s.shape[-1] for s in sequences)
    out = sequences[0].new_full((len(sequences), *sequences[0].shape[:-1], length), pad_value)
    for b, s in enumerate(sequences):
        out[b, ..., length - s.shape[-1] :] = s
    return out


def collate_prompts(samples: Sequence[dict[str, Any]], pad_token_id: int) -> Batch:
    """RLDataset samples -> a prompt Batch."""
    if not samples:
        raise ValueError("collate_prompts: no samples")
    input_ids = left_pad([s["input_ids"] for s in samples], pad_token_id)  # (B, P)
    lengths = torch.tensor([s["input_ids"].shape[-1] for s in samples])
    positions = torch.arange(input_ids.shape[1])
    attention_mask = positions[None, :] >= (input_ids.shape[1] - lengths)[:, None]  # (B, P)
    position_ids = left_pad([s["position_ids"] for s in samples], 0)  # (B, 4, P) or (B, P)
    return Batch(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        objects={k: [s[k] for s in samples] for k in (*PROMPT_OBJECT_KEYS, ORIGINAL_IMAGES_KEY) if k in samples[0]},
    )


def concat_multi_modal_inputs(inputs: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-sample vision inputs concatenated on dim 0 in sample order (the order the model consumes
    image tokens), for ``model(..., **concat_multi_modal_inputs(mm))``."""
    out: dict[str, Tensor] = {}
    keys = sorted({k for mm in inputs for k in mm})
    for key in keys:
        parts = [mm[key] for mm in inputs if key in mm]
        out[key] = torch.cat(parts, dim=0)
    return out
