"""A synthetic visual question-answering task (``colour``, ``shape``, ``count``) that a tiny VLM can learn,
rendered with Pillow without anti-aliasing (tests read the answer back from the pixels). Rows have EasyR1's
format; a hash of each (image, question) pair picks its split (:func:`split_of`), so splits never share one.
docs/builtin_assets.md, "The synthetic task"."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from PIL import Image, ImageDraw

from easyvlm.utils.cache import build_once, cache_root

# Bump when rendering, questions or row format change (it is part of the cache key).
BUILD_VERSION = 1

BACKGROUND = (255, 255, 255)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("1", "2", "3", "4")

QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "Which shape is this?",
    "count": "How many {colour} shapes are there?",
}
TASKS = tuple(QUESTIONS)

SINGLE_SIZE = 56  # px; 4 image tokens with the built-in processor (2x2 merged 28 px patches)
GRID_CELL = 28
GRID_CELLS = 3  # count images: 84x84 px, 9 image tokens

# Content hash buckets (of 10) per split: 80% of the content space is train, 10% val, 10% test.
SPLIT_BUCKETS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
SPLIT_SEEDS = {"train": 1, "val": 2, "test": 3}
DEFAULT_SIZES = {"train": 2000, "val": 256, "test": 256}


@dataclass(frozen=True)
class SyntheticDatasetSpec:
    """A task mix: ``tasks`` maps task name -> sampling weight."""

    tasks: dict[str, float]
    description: str = ""


BUILTIN_DATASETS: dict[str, SyntheticDatasetSpec] = {
    # Colour is the easiest task; the default mix leans on it so that a short RL run shows learning.
    "synthetic": SyntheticDatasetSpec({"colour": 0.5, "shape": 0.25, "count": 0.25}, "default mix"),
    "synthetic-colour": SyntheticDatasetSpec({"colour": 1.0}, "colour questions only"),
    "synthetic-shape": SyntheticDatasetSpec({"shape": 1.0}, "shape questions only"),
    "synthetic-count": SyntheticDatasetSpec({"count": 1.0}, "counting questions only"),
}

# Built-in data sets that other modules build: name -> module. The module provides
# ``dataset_cache_dir`` and ``materialize_dataset`` with the signatures of this module's; it is
# imported on first use (it imports this module, not the other way round).
EXTERNAL_DATASETS: dict[str, str] = {
    "synthetic-video": "easyvlm.builtin.synthetic_video",
    "synthetic-video-frames": "easyvlm.builtin.synthetic_video",
    "synthetic-video-direction": "easyvlm.builtin.synthetic_video",
    "synthetic-zoom": "easyvlm.builtin.synthetic_zoom",
    "synthetic-gui": "easyvlm.builtin.synthetic_gui",
    "synthetic-gui-row": "easyvlm.builtin.synthetic_gui",
    "synthetic-gui-row-red": "easyvlm.builtin.synthetic_gui",
    "synthetic-preference": "easyvlm.builtin.synthetic_preference",
    "synthetic-colour-preference": "easyvlm.builtin.synthetic_preference",
}


def builtin_dataset_names() -> list[str]:
    """Every name ``builtin:<name>@<split>`` accepts."""
    return sorted({*BUILTIN_DATASETS, *EXTERNAL_DATASETS})


class SyntheticDatasetError(ValueError):
    """A bad request for a synthetic data set (unknown name, split or task)."""


# ---------------------------------------------------------------------------------------------
# Answers


_NUMBER_WORDS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine".split())}


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, collapse whitespace, number words -> digits, grey -> gray:
    ``normalize_answer(" Red.") == "red"``, ``normalize_answer("Three!") == "3"``."""
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    words = [_NUMBER_WORDS.get(w, w) for w in words]
    words = ["gray" if w == "grey" else w for w in words]
    return " ".join(words)


# ---------------------------------------------------------------------------------------------
# Rendering


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: int, cy: int, r: int, fill: tuple[int, int, int]) -> None:
    """Draw ``shape`` filling the box [cx-r, cx+r] x [cy-r, cy+r], without anti-aliasing."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        raise SyntheticDatasetError(f"unknown shape {shape!r}; known: {SHAPES}")


def _render_single(rng: random.Random) -> tuple[Image.Image, str, str]:
    """One shape of random kind, colour, size and position. Returns (image, shape, colour)."""
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(PALETTE))
    r = rng.randint(8, 18)
    cx, cy = rng.randint(r + 1, SINGLE_SIZE - r - 2), rng.randint(r + 1, SINGLE_SIZE - r - 2)
    image = Image.new("RGB", (SINGLE_SIZE, SINGLE_SIZE), BACKGROUND)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, PALETTE[colour])
    return image, shape, colour


def _render_count(rng: random.Random) -> tuple[Image.Image, str, int]:
    """1-4 shapes of a target colour + 0-2 of others, one per grid cell (never touching) -> (image, colour, count)."""
    colour = rng.choice(sorted(PALETTE))
    count = rng.randint(1, len(COUNTS))
    others = [c for c in sorted(PALETTE) if c != colour]
    fills = [colour] * count + [rng.choice(others) for _ in range(rng.randint(0, 2))]
    cells = rng.sample(range(GRID_CELLS * GRID_CELLS), len(fills))
    side = GRID_CELL * GRID_CELLS
    image = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for fill, cell in zip(fills, cells):
        r = rng.randint(6, 10)
        # Keep the shape's box inside [1, 27) of its cell: shapes in neighbouring cells stay apart.
        x0, y0 = (cell % GRID_CELLS) * GRID_CELL, (cell // GRID_CELLS) * GRID_CELL
        cx = x0 + rng.randint(r + 1, GRID_CELL - r - 2)
        cy = y0 + rng.randint(r + 1, GRID_CELL - r - 2)
        draw_shape(draw, rng.choice(SHAPES), cx, cy, r, PALETTE[fill])
    return image, colour, count


def render_sample(task: str, rng: random.Random) -> tuple[Image.Image, dict]:
    """A rendered image and its row fields (problem, answer, task, options), images not set."""
    if task == "colour":
        image, _, colour = _render_single(rng)
        row = {"problem": "<image>" + QUESTIONS["colour"], "answer": colour, "options": sorted(PALETTE)}
    elif task == "shape":
        image, shape, _ = _render_single(rng)
        row = {"problem": "<image>" + QUESTIONS["shape"], "answer": shape, "options": list(SHAPES)}
    elif task == "count":
        image, colour, count = _render_count(rng)
        question = QUESTIONS["count"].format(colour=colour)
        row = {"problem": "<image>" + question, "answer": str(count), "options": list(COUNTS)}
    else:
        raise SyntheticDatasetError(f"unknown synthetic task {task!r}; known: {list(TASKS)}")
    row["task"] = task
    return image, row


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _content_hash(image: Image.Image, problem: str) -> bytes:
    """Hash of the pixels and the question: equal iff the (image, question) pair is identical."""
    return hashlib.sha256(image.tobytes() + b"\0" + problem.encode()).digest()


def split_of(content_hash: bytes) -> str:
    bucket = int.from_bytes(content_hash[:8], "big") % 10
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


# ---------------------------------------------------------------------------------------------
# Data sets


def check_split(split: str) -> None:
    if split not in SPLIT_SEEDS:
        raise SyntheticDatasetError(f"unknown synthetic split {split!r}; known: {list(SPLIT_SEEDS)}")


def distinct_samples(
    split: str, num_samples: int, tasks: dict[str, float], render, content_hash, known_tasks, seed: int | None = None
):
    """``num_samples`` (media, row) pairs of ``split`` from ``render(task, rng)``, distinct by ``content_hash(media,
    problem)``, each kept only if the hash picks ``split``; deterministic given (split, num_samples, tasks, seed)."""
    check_split(split)
    if [t for t in tasks if t not in known_tasks] or not tasks or any(w < 0 for w in tasks.values()) or sum(tasks.values()) <= 0:
        raise SyntheticDatasetError(
            f"bad synthetic task mix {tasks}: give task -> weight (>= 0, not all 0) for tasks in {list(known_tasks)}"
        )
    rng = random.Random(SPLIT_SEEDS[split] if seed is None else seed)
    names, weights = sorted(tasks), [tasks[t] for t in sorted(tasks)]
    seen: set[bytes] = set()
    attempts = 0
    while len(seen) < num_samples:
        attempts += 1
        if attempts > 50 * num_samples + 1000:
            raise SyntheticDatasetError(
                f"could only find {len(seen)} distinct {split} samples of tasks {names} after {attempts} "
                f"tries; ask for fewer samples (num_samples={num_samples})"
            )
        task = rng.choices(names, weights)[0]
        media, row = render(task, rng)
        key = content_hash(media, row["problem"])
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        yield media, row


def generate_rows(split: str, num_samples: int, tasks: dict[str, float], seed: int | None = None):
    """Yield ``num_samples`` (image, row) pairs of ``split``, distinct within the split (:func:`distinct_samples`)."""
    return distinct_samples(split, num_samples, tasks, render_sample, _content_hash, TASKS, seed)


def write_dataset(out_dir: Path, split: str, num_samples: int, tasks: dict[str, float]) -> Path:
    """Write ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>_NNNNNN.png``."""
    return write_image_rows(out_dir, split, generate_rows(split, num_samples, tasks), ("task", "options"))


def write_image_rows(out_dir: Path, split: str, samples: Iterable[tuple[Image.Image, dict]],
                     columns: tuple[str, ...]) -> Path:
    """Write (image, row) pairs as ``<out_dir>/<split>.jsonl`` (problem, answer, image path, ``columns``) and PNGs."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{split}.jsonl"
    with open(jsonl, "w") as f:
        for i, (image, row) in enumerate(samples):
            rel = f"images/{split}_{i:06d}.png"
            (out_dir / rel).write_bytes(png_bytes(image))
            line = {"problem": row["problem"], "answer": row["answer"], "images": [rel], **{k: row[k] for k in columns}}
            f.write(json.dumps(line) + "\n")
    return jsonl


def build_split(target: Path, split: str, num_samples: int, write: Callable[[Path, str, int], Path]) -> Path:
    """``target/<split>.jsonl``, written once by ``write(out_dir, split, num_samples)`` (atomically) and cached."""
    build_once(target, lambda out: write(out, split, num_samples))
    return target / f"{split}.jsonl"


def dataset_cache_dir(
    split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic", num_samples: int | None = None
) -> Path:
    """The directory ``materialize_dataset`` fills (whether or not it exists yet)."""
    if name in EXTERNAL_DATASETS:
        return importlib.import_module(EXTERNAL_DATASETS[name]).dataset_cache_dir(split, cache_dir, name, num_samples)
    if name not in BUILTIN_DATASETS:
        raise SyntheticDatasetError(f"unknown built-in data set {name!r}; known: {builtin_dataset_names()}")
    return sized_cache_dir(name, split, num_samples, DEFAULT_SIZES, BUILD_VERSION, cache_dir)


def sized_cache_dir(
    name: str, split: str, num_samples: int | None, default_sizes: dict[str, int], build_version: int,
    cache_dir: str | os.PathLike | None,
) -> Path:
    """``<cache>/datasets/<name>-<split>-<n>-v<build_version>`` (n: ``num_samples``, else the split's
    default size); the image and video data sets share the layout."""
    check_split(split)
    n = default_sizes[split] if num_samples is None else num_samples
    if n <= 0:
        raise SyntheticDatasetError(f"num_samples must be positive, got {n}")
    return cache_root(cache_dir) / "datasets" / f"{name}-{split}-{n}-v{build_version}"


def materialize_dataset(
    split: str,
    cache_dir: str | os.PathLike | None = None,
    name: str = "synthetic",
    num_samples: int | None = None,
) -> Path:
    """The JSONL file of built-in data set ``name`` / ``split``, generated once (atomically) and cached.
    train: 2000 rows by default, val / test 256; ``num_samples`` overrides (a smaller split is not a
    prefix of a larger one). Names in ``EXTERNAL_DATASETS`` are built by their own module."""
    if name in EXTERNAL_DATASETS:
        module = importlib.import_module(EXTERNAL_DATASETS[name])
        return module.materialize_dataset(split, cache_dir=cache_dir, name=name, num_samples=num_samples)
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    n = DEFAULT_SIZES[split] if num_samples is None else num_samples
    build_once(target, lambda out: write_dataset(out, split, n, BUILTIN_DATASETS[name].tasks))
    return target / f"{split}.jsonl"


def resolve_builtin_dataset(spec: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """``builtin:<name>[@split]`` (split defaults to train) -> the JSONL path, materialised."""
    prefix = "builtin:"
    if not spec.startswith(prefix):
        raise SyntheticDatasetError(f"{spec!r} is not a built-in data set spec ('builtin:<name>@<split>')")
    name, _, split = spec[len(prefix) :].partition("@")
    return materialize_dataset(split or "train", cache_dir=cache_dir, name=name)


def main(argv: list[str] | None = None) -> None:
    """``python -m easyvlm.builtin.synthetic [split ...] [--name N] [--force]``: generate and print paths."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("splits", nargs="*", default=["train", "val"])
    parser.add_argument("--name", default="synthetic", choices=builtin_dataset_names())
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--cache-dir", default=None, help="default: $EASYVLM_CACHE or ~/.cache/easyvlm")
    parser.add_argument("--force", action="store_true", help="delete the cached split first")
    args = parser.parse_args(argv)
    for split in args.splits:
        if args.force:
            shutil.rmtree(dataset_cache_dir(split, args.cache_dir, args.name, args.num_samples), ignore_errors=True)
        path = materialize_dataset(split, args.cache_dir, args.name, args.num_samples)
        print(f"builtin:{args.name}@{split}: {path} ({sum(1 for _ in open(path))} rows)")


if __name__ == "__main__":
    main()
