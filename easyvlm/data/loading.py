"""Find and read the rows of a data set named by ``data.train_files`` / ``data.val_files``, lazily
where the format allows; each source names its rows in errors. docs/data.md, "Where data comes from"."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")

# Data sets the project builds itself, by name prefix (``builtin:``, registered by easyvlm.builtin):
# prefix -> (the whole spec -> the path of its data file; ValueError with the reason when it cannot).
_DATASET_SCHEMES: dict[str, Callable[[str], str]] = {}


def register_dataset_scheme(prefix: str, resolve: Callable[[str], str]) -> None:
    """Let data specs that start with ``prefix`` (e.g. ``builtin:synthetic@train``) name built data sets."""
    _DATASET_SCHEMES[prefix] = resolve


class DataError(ValueError):
    """A data set that cannot be used; the message says which file/row, what is wrong and what to do."""


@dataclass
class RowSource:
    """The rows of one file or one Hugging Face split. rows: ``len()`` and ``rows[i] -> dict``;
    base_dir: for relative image paths; line_numbers: JSONL's 1-based lines, for errors."""

    label: str
    rows: Sequence[dict]
    base_dir: Path | None = None
    line_numbers: list[int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        line = f" (line {self.line_numbers[index]})" if self.line_numbers is not None else ""
        return f"{self.label} row {index}{line}"


class _TableRows:
    """Rows of a pyarrow Table, converted to dicts one at a time."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict:
        return self.table.slice(index, 1).to_pylist()[0]


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"path@split"`` -> (path, split); a spec without ``@`` (or an existing path) -> (spec, None)."""
    if os.path.exists(os.path.expanduser(spec)) or "@" not in spec:
        return spec, None
    path, _, split = spec.rpartition("@")
    return path, split or None


def load_sources(spec: str | Sequence[str], key: str = "data.train_files") -> list[RowSource]:
    """All row sources named by ``spec``; ``key`` is used in errors."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    specs = [s.strip() for s in specs if s and s.strip()]
    if not specs:
        raise DataError(f"{key} is empty; give a data file, a directory, 'org/name@split' or 'builtin:synthetic@train'")
    sources: list[RowSource] = []
    for one in specs:
        sources += _load_one(one, key)
    return sources


def _load_one(spec: str, key: str) -> list[RowSource]:
    for prefix, resolve in _DATASET_SCHEMES.items():
        if spec.startswith(prefix):
            try:
                return [read_file(Path(resolve(spec)))]
            except ValueError as err:  # an unknown name or split, said by the scheme
                raise DataError(f"{key}: {err}") from err

    path, split = split_spec(spec)
    local = Path(os.path.expanduser(path))
    if local.is_file():
        return [read_file(local)]
    if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
        return [_load_saved_dataset(local, split, key)]
    if local.is_dir():
        files = _files_in_dir(local, split)
        if not files:
            which = f" for split {split!r} (files named '{split}*' or in a folder named '{split}')" if split else ""
            raise DataError(
                f"{key}: directory {str(local)!r} has no data files{which}; supported: {', '.join(SUPPORTED_SUFFIXES)}"
            )
        return [read_file(f) for f in files]
    if _looks_like_hub_name(path):
        return [_load_hub_dataset(path, split or "train", key)]
    raise DataError(
        f"{key}: {spec!r} is neither an existing file or directory nor a Hugging Face dataset name 'org/name[@split]'"
    )


def _load_saved_dataset(directory: Path, split: str | None, key: str) -> RowSource:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    import datasets

    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise DataError(f"{key}: {str(directory)!r} has splits {sorted(loaded)}, not {split!r}; use {directory}@<split>")
        return RowSource(f"{directory}@{split}", loaded[split], directory / split)
    return RowSource(str(directory), loaded, directory)


def _looks_like_hub_name(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not path.endswith(SUPPORTED_SUFFIXES)


def _files_in_dir(directory: Path, split: str | None) -> list[Path]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
    if split is None:
        return files

    def in_split(p: Path) -> bool:
        rel = p.relative_to(directory)
        stem = p.name.split(".")[0]
        named = stem == split or (stem.startswith(split) and not stem[len(split)].isalnum())
        return named or split in rel.parts[:-1]

    return [p for p in files if in_split(p)]


def read_file(path: Path) -> RowSource:
    """One local data file as a RowSource; a malformed file raises DataError naming it (and the line)."""
    path = Path(path)
    label = str(path)
    suffix = path.suffix
    try:
        if suffix == ".jsonl":
            rows, lines = _read_jsonl(path)
            return RowSource(label, rows, path.parent, lines)
        if suffix == ".json":
            return RowSource(label, _read_json(path), path.parent)
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                # Every value stays a string (pyarrow would turn an answer "4" into the int 4).
                return RowSource(label, list(csv.DictReader(f)), path.parent)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return RowSource(label, _TableRows(pq.read_table(path)), path.parent)
        if suffix == ".arrow":
            import datasets

            # The format `datasets` writes (Dataset.save_to_disk / its cache); decodes Image columns.
            return RowSource(label, datasets.Dataset.from_file(str(path)), path.parent)
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"cannot read data file {label!r}: {type(err).__name__}: {err}") from err
    raise DataError(f"data file {label!r} has an unsupported type; supported: {', '.join(SUPPORTED_SUFFIXES)}")


def _read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number}: not valid JSON ({err.msg} at column {err.colno})") from err
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
            lines.append(number)
    return rows, lines


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from err
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a JSON list of objects (one per row); for one object per line use .jsonl")
    return data


def _load_hub_dataset(name: str, split: str, key: str) -> RowSource:
    import datasets

    label = f"{name}@{split}"
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no") or os.environ.get(
            "HF_DATASETS_OFFLINE", "0"
        ).lower() not in ("", "0", "false", "no")
        reason = (
            "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set and it is not in the local Hugging Face cache"
            if offline
            else "it could not be loaded from the local Hugging Face cache or the hub"
        )
        raise DataError(
            f"{key}: Hugging Face dataset {name!r} (split {split!r}): {reason} ({type(err).__name__}: {err}). "
            f"On a machine with network access run `datasets.load_dataset({name!r})` once to fill the cache, "
            f"or save the split to a local file (e.g. `load_dataset(...).to_parquet('train.parquet')`) and set "
            f"{key}=path/to/train.parquet"
        ) from err
    return RowSource(label, dataset, None)

def describe(sources: Sequence[RowSource]) -> str:
    """A short human-readable list of the sources, for messages."""
    names = [s.label for s in sources]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def json_list_or_value(value: Any) -> Any:
    """A CSV cell holding a JSON list (``'["a.png", "b.png"]'``) -> the list; anything else unchanged."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value
