"""Convert checkpoints of older easyvlm versions to the safe-state format.

``python -m easyvlm.run.convert_checkpoint CHECKPOINT_OR_SAVE_DIR`` rewrites numpy RNG states as tensors (admitting
numpy's array type only) and writes the manifest; only for checkpoints you trust (docs/security.md)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from easyvlm.run.checkpoint import MANIFEST, CheckpointError, completed_steps, verify_checkpoint, write_manifest
from easyvlm.utils.safe_state import UnsafeStateError, read_dcp_metadata, refusal_reason


def _numpy_array_globals() -> list[Any]:
    """The globals a pickled ndarray needs (numpy 2 moved numpy.core to numpy._core; a file may
    name either), as `torch.serialization.safe_globals` takes them."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [np.ndarray, np.dtype, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct"), *_dtype_classes()]


def _dtype_classes() -> list[Any]:
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles some dtypes by their class
    return [getattr(dtypes, name) for name in ("UInt32DType", "Int64DType", "Float64DType") if dtypes and hasattr(dtypes, name)]


def _as_tensor_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """An older RNG state (numpy's keys as an ndarray, Python's as a tuple) in the tensor form of
    `easyvlm.utils.safe_state.rng_state`."""
    out = dict(rng)
    version, internal, gauss_next = rng["python"]
    out["python"] = (version, torch.as_tensor(list(internal), dtype=torch.int64), gauss_next)
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    out["numpy"] = (str(kind), torch.as_tensor(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return out


def convert_state_file(path: Path) -> bool:
    """Rewrite one state file in the safe format; False when it already was."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
        return False
    except Exception:  # noqa: BLE001 - the old format; read it with numpy's arrays admitted below
        pass
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(
            f"{path} holds objects beyond plain values, tensors and numpy arrays ({refusal_reason(err)}): "
            f"it was not written by easyvlm; refusing to convert it"
        ) from None
    if isinstance(state, dict) and "rng" in state:
        state["rng"] = _as_tensor_rng(state["rng"])
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    torch.load(tmp, map_location="cpu", weights_only=True)  # the result must load safely
    os.replace(tmp, path)
    return True


def convert_checkpoint(path: Path) -> list[Path]:
    """Convert the checkpoint ``path`` (a ``global_step_<N>`` directory); the files rewritten."""
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE file)")
    rewritten = [p for p in sorted(path.rglob("*.pt")) if convert_state_file(p)]
    for metadata in sorted(path.rglob(".metadata")):
        try:
            read_dcp_metadata(metadata)
        except UnsafeStateError as err:
            raise CheckpointError(f"refusing to convert {path}: {err}") from None
    if rewritten or not (path / MANIFEST).is_file():
        write_manifest(path)
    verify_checkpoint(path)
    return rewritten


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m easyvlm.run.convert_checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a global_step_<N> checkpoint, or a save directory holding several")
    args = parser.parse_args(argv)
    path: Path = args.path
    if (path / "COMPLETE").is_file():
        checkpoints = [path]
    elif path.is_dir():
        checkpoints = [path / f"global_step_{step}" for step in completed_steps(path)]
    else:
        checkpoints = []
    if not checkpoints:
        sys.stderr.write(f"easyvlm: {path} is neither a checkpoint (global_step_<N> holding COMPLETE) nor a directory of them\n")
        return 2
    for checkpoint in checkpoints:
        try:
            rewritten = convert_checkpoint(checkpoint)
        except CheckpointError as err:
            sys.stderr.write(f"easyvlm: {err}\n")
            return 2
        what = ", ".join(str(p.relative_to(checkpoint)) for p in rewritten) or "no state file needed it"
        print(f"easyvlm: {checkpoint}: converted ({what}); manifest written and verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
