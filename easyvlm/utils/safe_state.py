"""Training state saved and loaded without running code from a checkpoint (a pickle can call any function):
plain state is read with ``weights_only=True``, and DCP's ``.metadata`` and non-tensor items, which DCP itself
unpickles unrestricted, through :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`."""

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
    """A state file that loading would have to run code for, or not a state file at all."""


# ------------------------------------------------------------------------------------------------
# Plain state files (trainer_state.pt, extra_state_rank<r>.pt)


def load_state(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``; `UnsafeStateError` naming the file (and, for a refused global,
    the converter for older easyvlm checkpoints) otherwise."""
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
    for parent in path.parents:
        if parent.name.startswith("global_step_"):
            return parent
    return path.parent


def rng_state() -> dict[str, Any]:
    """Python's, numpy's, torch's (and CUDA's) generator states as tensors and plain values (weights_only-safe)."""
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
    """Admits only the globals of DCP ``.metadata`` files (found by reading real ones): DCP's metadata classes,
    torch's size, dtypes and layout, paths."""

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
    """DCP's default planner, reading non-tensor items with ``weights_only=True``."""

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
