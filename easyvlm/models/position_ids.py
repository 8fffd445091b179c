"""Position ids for a prompt batch: (B, 4, L) for mRoPE models (row 0 text, rows 1..3 T/H/W), else (B, L);
0 at padding. As transformers' ``get_rope_index`` but after a long Qwen2(.5)-VL video, where text continues
from the largest position + 1 as in Qwen's code and vLLM. docs/data.md, "The prompt batch"."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor

# model_type -> how videos are laid out. Qwen3-VL and Qwen3.5 put a text timestamp before every
# frame, so each frame is its own grid with t = 1 and no temporal scaling.
MROPE_MODEL_TYPES = {
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2_5",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3",
    "qwen3_5": "qwen3",
    "qwen3_5_moe": "qwen3",
}
MROPE_ROWS = 4  # text row + T/H/W


def uses_mrope(model_config: Any) -> bool:
    """True for the model families whose position ids are (B, 4, L) here."""
    return getattr(model_config, "model_type", None) in MROPE_MODEL_TYPES


def _check_config(model_config: Any) -> None:
    model_type = getattr(model_config, "model_type", None)
    if model_type not in MROPE_MODEL_TYPES and getattr(model_config, "vision_config", None) is not None:
        raise NotImplementedError(
            f"position ids for vision-language model_type {model_type!r} are not implemented; "
            f"supported: {sorted(MROPE_MODEL_TYPES)} (and any text-only model)"
        )


def text_position_ids(attention_mask: Tensor) -> Tensor:
    """(B, L) bool -> (B, L) int64: 0, 1, 2 ... over the True positions, 0 at padding."""
    mask = attention_mask.bool()
    return (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)


def _vision_positions(start: int, t: int, h: int, w: int, time_interval: float) -> Tensor:
    """(3, t*h*w) positions of one image/video grid (already divided by the merge size)."""
    temporal = (torch.arange(t) * time_interval).long() + start
    height = torch.arange(h) + start
    width = torch.arange(w) + start
    grid = torch.meshgrid(temporal, height, width, indexing="ij")
    return torch.stack(grid).reshape(3, -1)


def _mrope_one(
    ids: Tensor,
    image_grids: Iterator[Tensor],
    video_grids: Iterator[tuple[Tensor, float]],
    image_token_id: int,
    video_token_id: int,
    merge: int,
    sample: int,
) -> Tensor:
    """(n,) unpadded token ids of one sequence -> (3, n) T/H/W positions."""
    n = ids.numel()
    is_vision = (ids == image_token_id) | (ids == video_token_id)
    chunks: list[Tensor] = []
    pos = 0
    i = 0
    while i < n:
        if not is_vision[i]:
            nxt = torch.nonzero(is_vision[i:])
            end = n if nxt.numel() == 0 else i + int(nxt[0])
            chunks.append(torch.arange(pos, pos + end - i).expand(3, -1))
            pos += end - i
            i = end
            continue
        kind = "image" if ids[i] == image_token_id else "video"
        try:
            grid, interval = next(image_grids) if kind == "image" else next(video_grids)
        except StopIteration:
            raise ValueError(
                f"sample {sample}: more {kind}s in input_ids (token at position {i}) than rows in {kind}_grid_thw; "
                f"every {kind} must have one grid row, in order"
            ) from None
        t, h, w = (int(x) for x in grid)
        h, w = h // merge, w // merge
        n_tokens = t * h * w
        token_id = image_token_id if kind == "image" else video_token_id
        if i + n_tokens > n or not bool((ids[i : i + n_tokens] == token_id).all()):
            found = int((ids[i : i + n_tokens] == token_id).sum())
            raise ValueError(
                f"sample {sample}: {kind} grid (t, h, w) = {tuple(int(x) for x in grid)} needs {n_tokens} {kind} tokens "
                f"at position {i}, found {found}: input_ids and {kind}_grid_thw do not match"
            )
        chunk = _vision_positions(pos, t, h, w, interval)
        chunks.append(chunk)
        # The next text starts after the largest position so far, as in Qwen's own code and vLLM.
        # transformers 5.19 advances by the spatial extent only, which is the same for images and
        # Qwen3-VL's one-frame grids but not for a video whose time axis reaches further.
        pos = int(chunk.max()) + 1
        i += n_tokens
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(chunks, dim=1)


def get_position_ids(
    input_ids: Tensor,
    attention_mask: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    model_config: Any = None,
    second_per_grid_ts: Tensor | None = None,
) -> Tensor:
    """Position ids of a padded batch: input_ids, attention_mask (B, L); image_grid_thw (N_img, 3),
    video_grid_thw (N_vid, 3) in sample order; second_per_grid_ts (N_vid,) (Qwen2.5-VL, default 1).
    Returns (B, 4, L) int64 for mRoPE models, else (B, L). Raises ValueError when vision tokens and
    grid rows do not match, naming the sample."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"get_position_ids: input_ids must be (B, L) and attention_mask the same shape; "
            f"got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    text = text_position_ids(mask)
    _check_config(model_config)
    if not uses_mrope(model_config):
        if image_grid_thw is not None or video_grid_thw is not None:
            raise ValueError(
                f"get_position_ids: model_type {getattr(model_config, 'model_type', None)!r} is text-only "
                f"but image/video grids were given"
            )
        return text

    family = MROPE_MODEL_TYPES[model_config.model_type]
    vision = model_config.vision_config
    merge = int(vision.spatial_merge_size)
    images = [(g, 1.0) for g in (image_grid_thw if image_grid_thw is not None else [])]
    videos: list[tuple[Tensor, float]] = []
    for k, grid in enumerate(video_grid_thw if video_grid_thw is not None else []):
        if family == "qwen3":
            videos += [(torch.tensor([1, int(grid[1]), int(grid[2])]), 1.0)] * int(grid[0])
        elif family == "qwen2_5":
            seconds = float(second_per_grid_ts[k]) if second_per_grid_ts is not None else 1.0
            videos.append((grid, float(vision.tokens_per_second) * seconds))
        else:
            videos.append((grid, 1.0))
    image_iter, video_iter = iter(images), iter(videos)

    cpu_ids, cpu_mask = input_ids.cpu(), mask.cpu()
    out = torch.zeros(input_ids.shape[0], MROPE_ROWS, input_ids.shape[1], dtype=torch.long)
    out[:, 0] = text.cpu()
    for b in range(input_ids.shape[0]):
        out[b, 1:, cpu_mask[b]] = _mrope_one(
            cpu_ids[b][cpu_mask[b]],
            image_iter,
            video_iter,
            int(model_config.image_token_id),
            int(model_config.video_token_id),
            merge,
            sample=b,
        )
    leftover = sum(1 for _ in image_iter), sum(1 for _ in video_iter)
    if any(leftover):
        raise ValueError(
            f"get_position_ids: {leftover[0]} image and {leftover[1]} video grid rows have no tokens in input_ids; "
            f"input_ids and image_grid_thw / video_grid_thw do not match"
        )
    return out.to(input_ids.device)


def extend_position_ids(prompt_position_ids: Tensor, response_length: int) -> Tensor:
    """Append the positions of ``response_length`` generated text tokens: (B, P) -> (B, P+T) or
    (B, R, P) -> (B, R, P+T), token j at ``last prompt position + 1 + j`` in every row. Equals
    ``get_rope_index`` over prompt + response because the prompt is left padded and ends in text."""
    if response_length < 0:
        raise ValueError(f"extend_position_ids: response_length must be >= 0, got {response_length}")
    steps = torch.arange(1, response_length + 1, device=prompt_position_ids.device)
    last = prompt_position_ids[..., -1:]
    return torch.cat([prompt_position_ids, last + steps], dim=-1)


def to_model_layout(position_ids: Tensor) -> Tensor:
    """(B, R, L) -> (R, B, L), what transformers' Qwen-VL forward takes; (B, L) is returned as is."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
