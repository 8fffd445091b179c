"""A synthetic video question-answering task that needs temporal order: ``NUM_FRAMES`` = 4 frames of 56x56 px
at ``FPS`` = 2 (8 video tokens). ``order``: a shape changes colour A -> B at frame 2, answer A; ``direction``:
a shape moves 4-6 px per frame, answer ``left|right|up|down``. Lossless RGB H.264 (decoded frames equal the
rendered ones) or PNG frame lists; splits by the image task's rule. docs/data.md, "Where data comes from"."""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from easyvlm.builtin.synthetic import (
    BACKGROUND,
    PALETTE,
    SHAPES,
    SINGLE_SIZE,
    SyntheticDatasetError,
    distinct_samples,
    sized_cache_dir,
    draw_shape,
    png_bytes,
)
from easyvlm.data.videos import write_video
from easyvlm.utils.cache import build_once

# Bump when rendering, encoding, questions or row format change (it is part of the cache key).
BUILD_VERSION = 1

FPS = 2
NUM_FRAMES = 4
FRAME_SIZE = SINGLE_SIZE  # 56 px: 2x2 merged patches per frame pair
DIRECTIONS = ("left", "right", "up", "down")
_STEPS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

QUESTIONS = {
    "order": "Which colour appears first?",
    "direction": "Which way does the shape move?",
}
TASKS = tuple(QUESTIONS)

DEFAULT_SIZES = {"train": 1000, "val": 128, "test": 128}

@dataclass(frozen=True)
class VideoDatasetSpec:
    """A task mix (task -> sampling weight) and how videos are stored: a file or a list of frames."""

    tasks: dict[str, float]
    as_frames: bool = False
    description: str = ""


VIDEO_DATASETS: dict[str, VideoDatasetSpec] = {
    "synthetic-video": VideoDatasetSpec({"order": 1.0}, False, "colour order, MP4 files"),
    "synthetic-video-frames": VideoDatasetSpec({"order": 1.0}, True, "colour order, lists of PNG frames"),
    "synthetic-video-direction": VideoDatasetSpec({"direction": 1.0}, False, "direction of motion, MP4 files"),
}


# ---------------------------------------------------------------------------------------------
# Rendering


def _frame(shape: str, cx: int, cy: int, r: int, colour: str) -> Image.Image:
    image = Image.new("RGB", (FRAME_SIZE, FRAME_SIZE), BACKGROUND)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, PALETTE[colour])
    return image


def _render_order(rng: random.Random) -> tuple[list[Image.Image], str]:
    """Frames 0-1: a shape in colour A; frames 2-3: the same shape and place in B != A. -> (frames, A)."""
    shape = rng.choice(SHAPES)
    first, second = rng.sample(sorted(PALETTE), 2)
    r = rng.randint(8, 18)
    cx, cy = rng.randint(r + 1, FRAME_SIZE - r - 2), rng.randint(r + 1, FRAME_SIZE - r - 2)
    half = NUM_FRAMES // 2
    colours = [first] * half + [second] * (NUM_FRAMES - half)
    return [_frame(shape, cx, cy, r, colour) for colour in colours], first


def _render_direction(rng: random.Random) -> tuple[list[Image.Image], str]:
    """One shape moving ``step`` px per frame in a direction; it stays inside the frame throughout."""
    shape, colour, direction = rng.choice(SHAPES), rng.choice(sorted(PALETTE)), rng.choice(DIRECTIONS)
    r, step = rng.randint(6, 12), rng.randint(4, 6)
    travel = step * (NUM_FRAMES - 1)
    lo, hi = r + 1, FRAME_SIZE - r - 2  # the shape's centre range, as in the image task
    dx, dy = _STEPS[direction]
    # Along the motion axis the start leaves room for the whole travel; across it, anywhere.
    start_x = rng.randint(lo + travel * (dx < 0), hi - travel * (dx > 0))
    start_y = rng.randint(lo + travel * (dy < 0), hi - travel * (dy > 0))
    frames = [_frame(shape, start_x + dx * step * t, start_y + dy * step * t, r, colour) for t in range(NUM_FRAMES)]
    return frames, direction


def render_sample(task: str, rng: random.Random) -> tuple[list[Image.Image], dict]:
    """Rendered frames and the row fields (problem, answer, task, options), videos not set."""
    if task == "order":
        frames, answer = _render_order(rng)
        options = sorted(PALETTE)
    elif task == "direction":
        frames, answer = _render_direction(rng)
        options = list(DIRECTIONS)
    else:
        raise SyntheticDatasetError(f"unknown synthetic video task {task!r}; known: {list(TASKS)}")
    return frames, {"problem": "<video>" + QUESTIONS[task], "answer": answer, "task": task, "options": options}


def _content_hash(frames: list[Image.Image], problem: str) -> bytes:
    """Hash of every frame's pixels and the question: equal iff the (clip, question) pair is identical."""
    digest = hashlib.sha256()
    for frame in frames:
        digest.update(frame.tobytes())
    digest.update(b"\0" + problem.encode())
    return digest.digest()


# ---------------------------------------------------------------------------------------------
# Data sets


def generate_rows(split: str, num_samples: int, tasks: dict[str, float], seed: int | None = None):
    """Yield ``num_samples`` (frames, row) pairs of ``split``, distinct within it (the image task's rule)."""
    return distinct_samples(split, num_samples, tasks, render_sample, _content_hash, TASKS, seed)


def write_dataset(
    out_dir: Path, split: str, num_samples: int, tasks: dict[str, float], as_frames: bool = False
) -> Path:
    """Write ``<out_dir>/<split>.jsonl`` and its clips: ``videos/<split>_NNNNNN.mp4``, or with
    ``as_frames`` ``frames/<split>_NNNNNN_<k>.png``."""
    out_dir = Path(out_dir)
    (out_dir / ("frames" if as_frames else "videos")).mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{split}.jsonl"
    with open(jsonl, "w") as f:
        for i, (frames, row) in enumerate(generate_rows(split, num_samples, tasks)):
            if as_frames:
                video: str | list[str] = [f"frames/{split}_{i:06d}_{k}.png" for k in range(len(frames))]
                for rel, frame in zip(video, frames):
                    (out_dir / rel).write_bytes(png_bytes(frame))
            else:
                video = f"videos/{split}_{i:06d}.mp4"
                write_video(out_dir / video, frames, FPS)
            columns = {"problem": row["problem"], "answer": row["answer"], "videos": [video]}
            f.write(json.dumps({**columns, "task": row["task"], "options": row["options"]}) + "\n")
    return jsonl


def dataset_cache_dir(
    split: str,
    cache_dir: str | os.PathLike | None = None,
    name: str = "synthetic-video",
    num_samples: int | None = None,
) -> Path:
    """The directory ``materialize_dataset`` fills (whether or not it exists yet)."""
    if name not in VIDEO_DATASETS:
        raise SyntheticDatasetError(f"unknown built-in video data set {name!r}; known: {sorted(VIDEO_DATASETS)}")
    return sized_cache_dir(name, split, num_samples, DEFAULT_SIZES, BUILD_VERSION, cache_dir)


def materialize_dataset(
    split: str,
    cache_dir: str | os.PathLike | None = None,
    name: str = "synthetic-video",
    num_samples: int | None = None,
) -> Path:
    """The JSONL file of video data set ``name`` / ``split``, generated once (atomically) and cached.
    train: 1000 rows by default, val / test 128; ``num_samples`` overrides the size."""
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    n = DEFAULT_SIZES[split] if num_samples is None else num_samples
    spec = VIDEO_DATASETS[name]
    build_once(target, lambda out: write_dataset(out, split, n, spec.tasks, as_frames=spec.as_frames))
    return target / f"{split}.jsonl"
