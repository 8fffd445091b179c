"""Collation: samples -> a prompt Batch, and per-sample vision inputs -> one forward's inputs.

A prompt Batch (from :func:`collate_prompts`):

    tensors  input_ids       (B, P) int64, left padded with the tokenizer's pad id
             attention_mask  (B, P) bool, True = real token
             position_ids    (B, 4, P) int64 for mRoPE models (row 0 text, rows 1..3 T/H/W), else (B, P);
                             0 at padding. transformers wants (4, B, P): models.position_ids.to_model_layout
    objects  raw_prompt_ids  list[int] per sample, unpadded, ONE pad token per image and video: the ids
                             vLLM gets (it expands each to exactly the tokens in input_ids)
             images          list of fitted PIL images per sample (what vLLM gets; [] for text-only)
             videos          list of easyvlm.data.videos.Video per sample (sampled, fitted frames; [] if none)
             multi_modal_inputs  dict per sample: pixel_values (N_patches, D), image_grid_thw (N_img, 3),
                             pixel_values_videos, video_grid_thw, second_per_grid_ts (Qwen2.5-VL); {} if none
             ground_truth, uid, prompt_text, extra (dict of the row's other columns)

For a (micro-)batch forward, :func:`concat_multi_modal_inputs` joins the samples' vision inputs in
sample order, which is the order the model consumes image tokens in ``input_ids``.
"""

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
    """RLDataset samples -> a prompt Batch (layout in the module docstring)."""
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
    """Join per-sample vision inputs for one forward over those samples (in the same order).

    ``pixel_values`` (N_i, D) are concatenated along dim 0, ``image_grid_thw`` (n_i, 3) likewise
    (= the grids of all images stacked in sample order); the same for video keys. Samples with
    ``{}`` (text-only) contribute nothing; if no sample has images the result is ``{}``. Pass the
    result as keyword arguments to the model: ``model(input_ids, ..., **concat_multi_modal_inputs(mm))``.
    """
    out: dict[str, Tensor] = {}
    keys = sorted({k for mm in inputs for k in mm})
    for key in keys:
        parts = [mm[key] for mm in inputs if key in mm]
        out[key] = torch.cat(parts, dim=0)
    return out
