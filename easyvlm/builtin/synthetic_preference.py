"""``builtin:synthetic-preference@<split>`` and ``builtin:synthetic-colour-preference@<split>``: pairs on the
synthetic splits for ``python -m easyvlm.rm``: ``chosen`` the rule-right answer, ``rejected`` a wrong one
(another option or task's answer, the answer twice, empty, random letters: a reward model never shown empty
responses was gamed by answering nothing). docs/rewards.md, "Model-based rewards: a trained reward model"."""

from __future__ import annotations

import json
import os
import random
import string
from pathlib import Path

from easyvlm.builtin.synthetic import (
    BUILTIN_DATASETS,
    COUNTS,
    PALETTE,
    SHAPES,
    SPLIT_SEEDS,
    SyntheticDatasetError,
    generate_rows,
    png_bytes,
    sized_cache_dir,
)
from easyvlm.utils.cache import build_once

BUILD_VERSION = 3
# name -> the synthetic data set whose questions it pairs (easyvlm.builtin.synthetic.BUILTIN_DATASETS)
DATASETS = {"synthetic-preference": "synthetic", "synthetic-colour-preference": "synthetic-colour"}
DEFAULT_SIZES = {"train": 2000, "val": 256, "test": 256}
_ALL_ANSWERS = (*sorted(PALETTE), *SHAPES, *COUNTS)


def preference_pair(answer: str, options: list[str], rng: random.Random) -> tuple[str, str]:
    """(chosen, rejected) for a question whose right answer is ``answer`` among ``options``."""
    chosen = answer
    kind = rng.random()
    if kind < 0.6:
        rejected = rng.choice([o for o in options if o != answer])
    elif kind < 0.7:
        rejected = rng.choice([a for a in _ALL_ANSWERS if a not in options])
    elif kind < 0.8:
        rejected = f"{answer} {answer}"
    elif kind < 0.9:
        rejected = ""
    else:
        rejected = answer
        while rejected == answer:  # three random letters could spell "red"
            rejected = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 3)))
    return chosen, rejected


def write_dataset(out_dir: Path, split: str, num_samples: int, questions: str = "synthetic") -> Path:
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{split}.jsonl"
    rng = random.Random(SPLIT_SEEDS[split] + 7919)  # the responses' own stream, per split
    with open(jsonl, "w") as f:
        for i, (image, row) in enumerate(generate_rows(split, num_samples, BUILTIN_DATASETS[questions].tasks)):
            rel = f"images/{split}_{i:06d}.png"
            (out_dir / rel).write_bytes(png_bytes(image))
            chosen, rejected = preference_pair(row["answer"], row["options"], rng)
            f.write(json.dumps({"prompt": row["problem"], "images": [rel], "chosen": chosen, "rejected": rejected,
                                "task": row["task"], "answer": row["answer"]}) + "\n")
    return jsonl


def dataset_cache_dir(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-preference",
                      num_samples: int | None = None) -> Path:
    if name not in DATASETS:
        raise SyntheticDatasetError(f"unknown built-in preference data set {name!r}; known: {list(DATASETS)}")
    return sized_cache_dir(name, split, num_samples, DEFAULT_SIZES, BUILD_VERSION, cache_dir)


def materialize_dataset(split: str, cache_dir: str | os.PathLike | None = None, name: str = "synthetic-preference",
                        num_samples: int | None = None) -> Path:
    """The JSONL file of ``builtin:<name>@<split>``, generated once (atomically) and cached."""
    target = dataset_cache_dir(split, cache_dir, name, num_samples)
    n = DEFAULT_SIZES[split] if num_samples is None else num_samples
    build_once(target, lambda out: write_dataset(out, split, n, DATASETS[name]))
    return target / f"{split}.jsonl"
