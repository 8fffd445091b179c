"""The rows of the GUI-style environment (easyvlm.agents.gui): ``builtin:synthetic-gui@<split>``
(the random layout) and ``builtin:synthetic-gui-row@<split>`` (the row layout).

Each row is an episode's start: the first 112x112 screenshot, the instruction, and the ``seed``
and ``task`` (and, for the row layout, ``layout``) from which ``GuiEnvironment.reset`` rebuilds the
screen; ``answer`` is one shortest solution and ``max_steps`` its length + 2. Splits by the image
task's rule. docs/agents.md, "The GUI environment".
"""

from __future__ import annotations

import hashlib
import os
import random
from functools import partial
from pathlib import Path

from PIL import Image

from easyvlm.agents.gui import KINDS, make_task, render_screen, solution
from easyvlm.builtin.synthetic import SyntheticDatasetError, build_split, distinct_samples, sized_cache_dir, write_image_rows

# Bump when the screens, the tasks or the row format change (it is part of the cache key).
BUILD_VERSION = 1

# name -> layout. The random layout's rows carry no layout column (a row without one is random), so
# they are the rows built before the row layout existed.
DATASETS = {"synthetic-gui": "random", "synthetic-gui-row": "row"}
DEFAULT_SIZES = {"train": 2000, "val": 128, "test": 128}
TASK_MIX = {"tick": 0.5, "untick": 0.5}


def render_sample(task: str, rng: random.Random, layout: str = "random") -> tuple[Image.Image, dict]:
    """A new seed from ``rng``, its task of kind ``task`` in ``layout`` and its first screenshot."""
    if task not in KINDS:
        raise SyntheticDatasetError(f"unknown GUI task {task!r}; known: {list(KINDS)}")
    seed = rng.getrandbits(31)
    screen = make_task(seed, task, layout=layout)
    row = {"problem": "<image>" + screen.instruction, "answer": solution(screen), "task": task, "seed": seed,
           "max_steps": screen.max_steps, "layout": layout}
    return render_screen(screen, screen.initial), row


def _content_hash(image: Image.Image, problem: str) -> bytes:
    return hashlib.sha256(image.tobytes() + b"\0" + problem.encode()).digest()


def write_dataset(out_dir: Path, split: str, num_samples: int, layout: str = "random") -> Path:
    samples = distinct_samples(split, num_samples, TASK_MIX, partial(render_sample, layout=layout), _content_hash, KINDS)
    columns = ("task", "seed", "max_steps") + (() if layout == "random" else ("layout",))
    return write_image_rows(out_dir, split, samples, columns)


def dataset_cache_dir(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-gui",
                      num_samples: int | None = None) -> Path:
    if name not in DATASETS:
        raise SyntheticDatasetError(f"unknown built-in GUI data set {name!r}; known: {list(DATASETS)}")
    return sized_cache_dir(name, split, num_samples, DEFAULT_SIZES, BUILD_VERSION, cache_dir)


def materialize_dataset(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-gui",
                        num_samples: int | None = None) -> Path:
    """The JSONL file of ``builtin:<name>@<split>``, generated once (atomically) and cached."""
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    n = DEFAULT_SIZES[split] if num_samples is None else num_samples
    return build_split(target, split, n, partial(write_dataset, layout=DATASETS[name]))
