"""A synthetic task that needs the zoom tool: 224x224 images with a 1 px striped patch (a colour and its
complement) per quadrant, which averages to grey under ``data.max_pixels = 112 * 112``. The question names a
quadrant (the tiny model cannot learn to find a marked one); ``box`` is that quadrant in the 112x112 view,
what reward_functions/zoom.py checks calls against. docs/agents.md, "The tools demo"."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

from PIL import Image

from easyvlm.builtin.synthetic import (PALETTE, SyntheticDatasetError, build_split, distinct_samples, sized_cache_dir,
                                       write_image_rows)

# Bump when rendering, questions or row format change (it is part of the cache key).
BUILD_VERSION = 2

IMAGE_SIZE = 224
VIEW_SIZE = 112  # the fitted view under data.max_pixels = 112 * 112
PATCH = 80
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION = "What colour are the stripes at the {where}?"
TASKS = ("zoom",)
DEFAULT_SIZES = {"train": 2000, "val": 128, "test": 128}
DATASETS = ("synthetic-zoom",)


# Single tokens of the builtin tool-calling model (tiny-qwen2.5-vl-tools): a zoom call on a quadrant
# is <tool_call> + CALL_PREFIX + one box + CALL_SUFFIX + </tool_call>, six tokens with its EOS. A real
# BPE vocabulary has multi-character tokens; a byte-level one would spell the call over ~60.
CALL_PREFIX = '{"name":"image_zoom","arguments":{"box":['
CALL_SUFFIX = "]}}"


def quadrant_box(quadrant: int, size: int = VIEW_SIZE) -> list[int]:
    """[x1, y1, x2, y2] of quadrant 0 (top left), 1 (top right), 2 (bottom left), 3 (bottom right)."""
    half = size // 2
    x, y = (quadrant % 2) * half, (quadrant // 2) * half
    return [x, y, x + half, y + half]


def striped_patch(colour: tuple[int, int, int], size: int = PATCH) -> Image.Image:
    """1 px vertical stripes of ``colour`` and its complement."""
    complement = tuple(255 - c for c in colour)
    patch = Image.new("RGB", (size, size), colour)
    pixels = patch.load()
    for x in range(1, size, 2):
        for y in range(size):
            pixels[x, y] = complement
    return patch


def render_sample(task: str, rng: random.Random) -> tuple[Image.Image, dict]:
    if task != "zoom":
        raise SyntheticDatasetError(f"unknown zoom task {task!r}; known: {list(TASKS)}")
    colours = rng.sample(sorted(PALETTE), 4)  # one per quadrant, all different
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    for quadrant, colour in enumerate(colours):
        x0, y0, _, _ = quadrant_box(quadrant, IMAGE_SIZE)
        # even offsets: the stripe pairs line up with the 2x2 pixels the fitted view averages
        room = (IMAGE_SIZE // 2 - PATCH - 4) // 2
        dx, dy = 2 * rng.randint(2, room), 2 * rng.randint(2, room)
        image.paste(striped_patch(PALETTE[colour]), (x0 + dx, y0 + dy))
    quadrant = rng.randrange(4)
    row = {"problem": "<image>" + QUESTION.format(where=QUADRANTS[quadrant]), "answer": colours[quadrant], "task": task,
           "options": sorted(PALETTE), "quadrant": quadrant, "box": quadrant_box(quadrant)}
    return image, row


def _content_hash(image: Image.Image, problem: str) -> bytes:
    return hashlib.sha256(image.tobytes() + b"\0" + problem.encode()).digest()


def write_dataset(out_dir: Path, split: str, num_samples: int) -> Path:
    samples = distinct_samples(split, num_samples, {"zoom": 1.0}, render_sample, _content_hash, TASKS)
    return write_image_rows(out_dir, split, samples, ("task", "options", "quadrant", "box"))


def dataset_cache_dir(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-zoom",
                      num_samples: int | None = None) -> Path:
    if name not in DATASETS:
        raise SyntheticDatasetError(f"unknown built-in zoom data set {name!r}; known: {list(DATASETS)}")
    return sized_cache_dir(name, split, num_samples, DEFAULT_SIZES, BUILD_VERSION, cache_dir)


def materialize_dataset(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-zoom",
                        num_samples: int | None = None) -> Path:
    """The JSONL file of ``builtin:synthetic-zoom@<split>``, generated once (atomically) and cached."""
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    return build_split(target, split, DEFAULT_SIZES[split] if num_samples is None else num_samples, write_dataset)


def zoom_call(box: list[int]) -> str:
    """The compact Hermes-format zoom call of ``box`` (what the warm start teaches)."""
    return "<tool_call>" + CALL_PREFIX + ",".join(map(str, box)) + CALL_SUFFIX + "</tool_call>"


def call_tokens() -> tuple[str, ...]:
    """The word tokens a zoom call is made of (the tags, the prefix, the four boxes, the suffix)."""
    return ("<tool_call>", "</tool_call>", CALL_PREFIX, *(",".join(map(str, quadrant_box(q))) for q in range(4)), CALL_SUFFIX)
