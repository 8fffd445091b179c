"""The data pipeline's settings, declared once: what the loaders read (files, columns, media,
prompt shaping, lengths, batching, bad rows). The config schema composes them as the ``data``
section; the plan hands the loaders the section with its paths made absolute. Torch-free: the
config check imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class DataConfig:
    train_files: str = ""
    """Training prompts: a hub data set id, a local file (JSON, JSONL, Parquet) or directory, or
    `builtin:synthetic`. `path@split` selects a split (default `train`)."""
    val_files: str = ""
    """Validation prompts, same forms as `train_files`. Empty: no validation data (then validation
    must be off: `trainer.val_freq=-1`, `trainer.val_before_train=false`)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text; `<image>` / `<video>` in it mark where the media go."""
    answer_key: str = "answer"
    """Column holding the answer; it reaches the reward function as `ground_truth`."""
    image_key: str = "images"
    """Column holding the images of a row (paths, bytes or dicts); absent or empty = text only."""
    video_key: str = "videos"
    """Column holding the videos of a row."""
    image_dir: Optional[str] = None
    """Directory that relative image and video paths in the data are relative to. None: the data
    file's directory, then the working directory (EasyR1: the working directory only), so that a
    data set directory can be moved as a whole and EasyR1's working-directory paths still work."""
    video_fps: float = 2.0
    """Frames per second sampled from video files (qwen-vl-utils' rule: at least 4 frames, an even
    count); a row's list of frame images is taken as sampled at this rate."""
    video_max_frames: int = 768
    """easyvlm extra. Most frames kept of one video (qwen-vl-utils' `max_frames`, which EasyR1
    leaves at 768): a file is sampled at fewer frames, a longer frame list is a bad row."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (image tokens included), P."""
    max_response_length: int = 512
    """Most tokens generated per response, T."""
    rollout_batch_size: int = 512
    """Prompts per training step (verl's `data.train_batch_size`). Each is sampled
    `worker.rollout.n` times."""
    mini_rollout_batch_size: Optional[int] = None
    """Prompts per generation round (verl's `data.gen_batch_size`). None: one round of
    `rollout_batch_size`. With online filtering, rounds repeat until `rollout_batch_size` prompts
    survive the filter."""
    val_batch_size: int = -1
    """Prompts per validation generation call; -1 = the whole validation set at once."""
    format_prompt: Optional[str] = None
    """Jinja file that wraps each prompt (rendered with `content` = the prompt text). None: the
    prompt is used as is."""
    override_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own. None: use the tokenizer's."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 1
    """Seed of the training data shuffle."""
    # EasyR1's defaults, so its configs mean the same here (worker.judge and the reward-model trainer
    # have their own, each saying why)
    min_pixels: Optional[int] = 262144
    """Images smaller than this many pixels are upscaled (aspect kept, sides truncated, as EasyR1's
    `process_image`); the model processor's own limits then round the sides to its patch grid, so
    the final pixel count can fall slightly outside. None: no lower limit."""
    max_pixels: Optional[int] = 4194304
    """Images larger than this many pixels are downscaled (as `min_pixels`). None: no upper limit."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` tokens when the data set is loaded."""
    filter_overlong_prompts_workers: int = 16
    """Processes used to tokenize prompts for `filter_overlong_prompts`."""
    prompt_truncation: Literal["error", "left", "right"] = "error"
    """easyvlm extra. What to do with a prompt longer than `max_prompt_length` that was not
    filtered: `error` stops with the row's index; `left` / `right` cut tokens from that side."""
    system_prompt: Optional[str] = None
    """easyvlm extra. A system message put before every prompt. None: none (the chat template's
    default, if any, applies)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """easyvlm extra. A row that cannot be read (missing column, unreadable image): `raise` stops
    with the row's index; `skip` drops it and counts it in the logs."""
