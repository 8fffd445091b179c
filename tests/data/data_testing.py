"""Helpers for the data pipeline tests: configs, files of rows, images."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PIL import Image

from easyvlm.config.schema import DataConfig

# Pixel limits for the tiny model: factor 28; 56x56 = 4 tokens ... 224x224 = 64 tokens.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64


def data_config(**overrides) -> DataConfig:
    base = dict(
        train_files="",
        prompt_key="problem",
        answer_key="answer",
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        max_prompt_length=256,
        rollout_batch_size=2,
        filter_overlong_prompts=False,
        filter_overlong_prompts_workers=1,
    )
    base.update(overrides)
    return dataclasses.replace(DataConfig(), **base)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_image(path: Path, width: int, height: int, colour=(200, 30, 30), mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (width, height), colour)
    # a second colour so that resizing and patch order show in the pixel values
    image.paste((20, 40, 220), (0, 0, max(1, width // 3), max(1, height // 2)))
    image.convert(mode).save(path)
    return path
