"""Saving and loading training state so that loading a checkpoint never runs code from it.

A pickle can call any importable function while it is read, so a crafted checkpoint file runs
arbitrary code on every node that resumes from it. easyvlm therefore saves only plain state
(tensors, dicts, lists, tuples, numbers, strings, None) and reads it back with PyTorch's
``weights_only`` unpickler, which refuses every other global. RNG states are kept as tensors
(numpy's generator state is an ndarray, which that unpickler refuses: :func:`rng_state` stores it
as a tensor).

Sharded model and optimizer states go through ``torch.distributed.checkpoint`` (DCP), whose
file-system reader unpickles its ``.metadata`` with plain ``pickle`` and whose default planner
reads non-tensor items with ``weights_only`` off. DCP takes a storage reader and a load planner
as arguments: :class:`SafeFileSystemReader` reads the metadata with an unpickler that admits
only DCP's own metadata classes, and :class:`SafeLoadPlanner` reads non-tensor items with
``weights_only=True``. Tensor data itself DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

CONVERT_COMMAND = "python -m easyvlm.run.convert_checkpoint"


class UnsafeStateError(ValueError):
    """A state file cannot be loaded safely: it holds objects that loading would have to construct
    by running code, or it is not a state file at all."""


# ------------------------------------------------------------------------------------------------
# Plain state files (trainer_state.pt, extra_state_rank<r>.pt)


def load_state(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``. Raises `UnsafeStateError` naming the file: for a
    refused object, with the offending global and the converter for checkpoints of older easyvlm
    versions; for a file that is not a PyTorch state file at all."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = refusal_reason(err)
        if "GLOBAL" in reason or "Unsupported" in reason:
            raise UnsafeStateError(
                f"{path} holds objects that a safe load refuses ({reason}); loading it would run code from "
                f"the file. A checkpoint written by easyvlm before its safe-state format (which kept numpy "
                f"arrays in it) can be converted, if you trust where it came from: {CONVERT_COMMAND} "
                f"{_checkpoint_dir(path)}. Any other such file: do not load it"
            ) from None
        raise UnsafeStateError(f"{path} is not a readable state file ({reason})") from None
    except Exception as err:  # noqa: BLE001 - torch.load of a damaged file raises almost anything
        raise UnsafeStateError(f"{path} is not a readable state file ({type(err).__name__}: {err})") from None


def refusal_reason(err: Exception) -> str:
    """The line of PyTorch's message that names what it refused (the rest is generic advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line:
            return line.rstrip(".")
    return lines[0] if lines else type(err).__name__


def _checkpoint_dir(path: Path) -> Path:
    """The ``global_step_<N>`` directory a state file lies in (or the file's own directory)."""
    for parent in path.parents:
        if parent.name.startswith("global_step_"):
            return parent
    return path.parent


def rng_state() -> dict[str, Any]:
    """Python's, numpy's, torch's (and CUDA's) generator states, as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss_next),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss_next))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the globals a DCP ``.metadata`` file holds (found by reading real ones): DCP's own
    metadata classes, torch's size, dtypes and layout, and a path; nothing that can run code."""

    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
              ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:  # a class of DCP's, not an import
                return found
        elif (module, name) in self._NAMES:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """A DCP checkpoint's ``.metadata`` (``path``: the file), read without running code from it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UnsafeStateError(f"{path} holds objects that a safe load refuses ({err}); do not load it") from None
    except (EOFError, ValueError, AttributeError, TypeError) as err:
        raise UnsafeStateError(f"{path} is not a readable checkpoint metadata file ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeStateError(f"{path} is not checkpoint metadata (it holds a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` with :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"  # DCP's names for the file
        metadata = read_dcp_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor items (optimizer hyper-parameters, step counts)
    with ``weights_only=True``. The checked object is written again by us and handed to the default
    implementation, so what it unpickles is our own plain bytes."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            checked = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeStateError(
                f"checkpoint item {read_item.dest_index.fqn!r} holds objects that a safe load refuses "
                f"({refusal_reason(err)}); do not load this checkpoint"
            ) from None
        plain = io.BytesIO()
        torch.save(checked, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)
