"""Peak memory of the calling process (no torch, no Ray) and the driver's ``perf/*`` memory metrics."""

from __future__ import annotations

import resource
import sys
from typing import Any, Mapping, Sequence

GiB = 1024**3
PEAK_RSS_PREFIX = "perf/peak_rss_gb"
CUDA_ALLOCATED_PREFIX = "perf/max_memory_allocated_gb"  # EasyR1's names (torch.cuda.max_memory_*)
CUDA_RESERVED_PREFIX = "perf/max_memory_reserved_gb"


def peak_rss_bytes() -> int:
    """Peak resident bytes of this process (children excluded): Linux ``VmHWM``, not ``ru_maxrss``, which
    a fork+exec'd child inherits from its parent; ``ru_maxrss`` elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_rss_metrics(peaks: Mapping[str, int | Sequence[int]]) -> dict[str, float]:
    """``perf/peak_rss_gb/<name>`` in GiB; ``peaks``: name -> bytes, or a group -> its ranks' (largest logged)."""
    out = {}
    for name, value in peaks.items():
        values = [value] if isinstance(value, int) else list(value)
        if values:
            out[f"{PEAK_RSS_PREFIX}/{name}"] = max(values) / GiB
    return out


def cuda_peak_bytes() -> tuple[int, int] | None:
    """(allocated, reserved) high-water bytes of torch's CUDA allocator on the current device; None without CUDA
    or where torch was never imported (it is not imported for this)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def cuda_peak_metrics(peaks: Mapping[str, Sequence[tuple[int, int] | None]]) -> dict[str, float]:
    """EasyR1's CUDA peak keys per worker group (largest rank, GiB); none for a group without CUDA."""
    out = {}
    for name, answers in peaks.items():
        known = [a for a in answers if a is not None]
        if known:
            out[f"{CUDA_ALLOCATED_PREFIX}/{name}"] = max(a for a, _ in known) / GiB
            out[f"{CUDA_RESERVED_PREFIX}/{name}"] = max(r for _, r in known) / GiB
    return out


# ------------------------------------------------------------------------------ giving memory back
_MADV_DONTNEED = 4  # Linux


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def release_pages(address: int, nbytes: int) -> int:
    """Give the whole pages of a tensor's private anonymous memory back to the OS, keeping the allocation
    (``madvise(MADV_DONTNEED)``: the range then reads as zeros). Returns the bytes released (0 off Linux)."""
    import ctypes
    import mmap

    if not sys.platform.startswith("linux") or nbytes <= 0:
        return 0
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start:
        return 0
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
        return 0
    return end - start


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``, so freed temporaries do not stay resident into the next phase; no-op elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            _libc().malloc_trim(0)
        except AttributeError:  # another C library (musl)
            pass
