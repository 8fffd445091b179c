"""Which kernel runs a float32 CPU linear layer, oneDNN or ``F.linear`` (MKL): the faster as timed once per
shape class on this machine (oneDNN only when ``ONEDNN_MARGIN`` faster), logged once and kept per
:func:`machine_key` in ``$EASYVLM_CACHE/cpu-kernels/``, so later runs take the same kernels."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from easyvlm.utils.cache import cache_root

KERNELS = ("onednn", "aten")
# oneDNN is taken only when it is at least this much faster: within it the two are equal up to the
# timing noise of a shared machine, and F.linear is torch's default (the numerics of plain
# transformers and of TRL), so a near-tie keeps it and two machines of one kind rarely choose apart
ONEDNN_MARGIN = 0.05
# environment variables that cap the vector ISA of oneDNN or MKL: part of the machine key
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")


class ShapeClass(NamedTuple):
    rows: int  # a power of two: the call's rows (tokens), rounded up
    in_features: int
    out_features: int
    backward: bool  # a training call (forward + backward) or a forward alone

    @property
    def key(self) -> str:
        return f"{self.rows}x{self.in_features}->{self.out_features}" + (" fwd+bwd" if self.backward else " fwd")


def shape_class(rows: int, in_features: int, out_features: int, backward: bool) -> ShapeClass:
    return ShapeClass(1 << max(rows - 1, 0).bit_length(), in_features, out_features, backward)


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What the timings depend on besides the shape: CPU model, torch, threads, ISA limits."""
    limits = [f"{name}={os.environ[name]}" for name in ISA_VARIABLES if os.environ.get(name)]
    return " | ".join([cpu_model_name(), f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", *limits])


def default_cache_file(machine: str) -> Path:
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return cache_root() / "cpu-kernels" / f"{digest}.json"


def _log(message: str) -> None:
    print(f"easyvlm: {message}", file=sys.stderr, flush=True)


class KernelChooser:
    """The kernel of each shape class: from memory, else the cache file, else timed once (thread-safe). ``timer(shape)``:
    seconds per call of every name in :data:`KERNELS`; ``cache_file`` None keeps choices in memory."""

    def __init__(self, timer: Callable[[ShapeClass], dict[str, float]], machine: str, cache_file: Path | None,
                 log: Callable[[str], None] = _log):
        self._timer = timer
        self._machine = machine
        self._file = cache_file
        self._log = log
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = self._read().get("classes", {})
        self._choices: dict[ShapeClass, str] = {}  # the hot path: one dict lookup per linear call

    def kernel(self, shape: ShapeClass) -> str:
        choice = self._choices.get(shape)
        if choice is None:
            with self._lock:
                choice = self._choices.get(shape) or self._decide(shape)
        return choice

    def _decide(self, shape: ShapeClass) -> str:
        entry = self._entries.get(shape.key)
        if entry is None or entry.get("kernel") not in KERNELS:
            seconds = self._timer(shape)
            kernel = "onednn" if seconds["onednn"] < (1 - ONEDNN_MARGIN) * seconds["aten"] else "aten"
            entry = {"kernel": kernel, **{f"{name}_ms": round(seconds[name] * 1e3, 3) for name in KERNELS}}
            self._entries[shape.key] = entry
            self._log(f"CPU linear {shape.key}: oneDNN {entry['onednn_ms']:.2f} ms, torch F.linear "
                      f"{entry['aten_ms']:.2f} ms per call -> {kernel} (timed once on {self._machine}"
                      + (f"; kept in {self._file})" if self._file else ")"))
            self._write(shape.key, entry)
        else:  # every run's log says which kernel each class takes, measured now or before
            self._log(f"CPU linear {shape.key}: {entry['kernel']} (oneDNN {entry['onednn_ms']:.2f} ms, torch F.linear "
                      f"{entry['aten_ms']:.2f} ms per call, timed before on this machine: {self._file})")
        self._choices[shape] = entry["kernel"]
        return entry["kernel"]

    def _read(self) -> dict:
        if self._file is None or not self._file.is_file():
            return {}
        try:
            data = json.loads(self._file.read_text())
        except (OSError, ValueError):  # a damaged file is re-measured, never trusted
            return {}
        return data if isinstance(data, dict) and data.get("machine") == self._machine else {}

    def _write(self, key: str, entry: dict) -> None:
        """Merge ``entry`` into the file and replace it by one rename; a failed write costs a re-measurement."""
        if self._file is None:
            return
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            classes = {**self._read().get("classes", {}), key: entry}
            fd, tmp = tempfile.mkstemp(prefix=f".{self._file.name}.", dir=self._file.parent)
            with os.fdopen(fd, "w") as out:
                json.dump({"machine": self._machine, "classes": classes}, out, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self._file)
        except OSError as err:
            self._log(f"could not keep the CPU linear kernel choices in {self._file}: {err}")
