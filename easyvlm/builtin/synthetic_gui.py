"""The rows of the GUI-style environment (easyvlm.agents.gui): ``builtin:synthetic-gui@<split>``
(the random layout), ``builtin:synthetic-gui-row@<split>`` (the row layout) and
``builtin:synthetic-gui-row-red@<split>`` (the row layout, every task about the red boxes).

Each row is an episode's start: the first 112x112 screenshot, the instruction, and the ``seed``
and ``task`` (and, for the row layout, ``layout``; for one colour, ``colour``) from which
``GuiEnvironment.reset`` rebuilds the screen; ``answer`` is one shortest solution and ``max_steps`` its length + 2. Splits by the image
task's rule. docs/agents.md, "The GUI environment".
"""

from __future__ import annotations

import hashlib
import os
import random
from functools import partial
from pathlib import Path

from PIL import Image

from easyvlm.agents.gui import KINDS, GuiTask, make_task, render_screen, solution
from easyvlm.builtin.synthetic import (SyntheticDatasetError, build_split, distinct_samples, sized_cache_dir, split_of,
                                      write_image_rows)

# Bump when the screens, the tasks or the row format change (it is part of the cache key).
BUILD_VERSION = 2  # 2: OK drawn as the dark primary button

# name -> (layout, colour: None for the seed's). The random layout's rows carry no layout or colour
# column (a row without them is random, of the seed's colour): the rows built before either existed.
DATASETS = {"synthetic-gui": ("random", None), "synthetic-gui-row": ("row", None),
            "synthetic-gui-row-red": ("row", "red")}
DEFAULT_SIZES = {"train": 2000, "val": 128, "test": 128}
# The row layout about red has 696 distinct screens (14 ways to place 1-3 red boxes among 4, the others
# in 3 colours, OK on either side, tick or untick): 563 train, 62 val and 71 test by the split's hash
# of the version-2 screens.
SIZES = {"synthetic-gui-row-red": {"train": 500, "val": 56, "test": 56}}
TASK_MIX = {"tick": 0.5, "untick": 0.5}


def render_sample(task: str, rng: random.Random, layout: str = "random", colour: str | None = None
                  ) -> tuple[Image.Image, dict]:
    """A new seed from ``rng``, its task of kind ``task`` in ``layout`` (about ``colour`` if given) and
    its first screenshot."""
    if task not in KINDS:
        raise SyntheticDatasetError(f"unknown GUI task {task!r}; known: {list(KINDS)}")
    seed = rng.getrandbits(31)
    screen = make_task(seed, task, layout=layout, colour=colour)
    row = {"problem": "<image>" + screen.instruction, "answer": solution(screen), "task": task, "seed": seed,
           "max_steps": screen.max_steps, "layout": layout, "colour": colour}
    return render_screen(screen, screen.initial), row


def _content_hash(image: Image.Image, problem: str) -> bytes:
    return hashlib.sha256(image.tobytes() + b"\0" + problem.encode()).digest()


def split_of_task(task: GuiTask) -> str:
    """The split whose rows may hold ``task`` (its first screen and instruction decide, as for the rows)."""
    return split_of(_content_hash(render_screen(task, task.initial), "<image>" + task.instruction))


def write_dataset(out_dir: Path, split: str, num_samples: int, layout: str = "random",
                  colour: str | None = None) -> Path:
    render = partial(render_sample, layout=layout, colour=colour)
    samples = distinct_samples(split, num_samples, TASK_MIX, render, _content_hash, KINDS)
    columns = ("task", "seed", "max_steps") + (() if layout == "random" else ("layout",))
    columns += () if colour is None else ("colour",)
    return write_image_rows(out_dir, split, samples, columns)


def dataset_cache_dir(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-gui",
                      num_samples: int | None = None) -> Path:
    if name not in DATASETS:
        raise SyntheticDatasetError(f"unknown built-in GUI data set {name!r}; known: {list(DATASETS)}")
    return sized_cache_dir(name, split, num_samples, SIZES.get(name, DEFAULT_SIZES), BUILD_VERSION, cache_dir)


def materialize_dataset(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-gui",
                        num_samples: int | None = None) -> Path:
    """The JSONL file of ``builtin:<name>@<split>``, generated once (atomically) and cached."""
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    n = SIZES.get(name, DEFAULT_SIZES)[split] if num_samples is None else num_samples
    layout, colour = DATASETS[name]
    return build_split(target, split, n, partial(write_dataset, layout=layout, colour=colour))
