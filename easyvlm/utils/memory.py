"""Peak resident memory of the calling process, and the step metrics made of every process's peak.

No torch, no Ray: the driver, every worker group's ranks and the reward actor call
:func:`peak_rss_bytes` in their own process, and the driver turns the answers into
``perf/peak_rss_gb/<process>`` with :func:`peak_rss_metrics`. On GPUs the ranks also answer
:func:`cuda_peak_bytes` (torch's CUDA allocator, read only where the process already imported
torch), which :func:`cuda_peak_metrics` turns into EasyR1's ``perf/max_memory_allocated_gb`` and
``perf/max_memory_reserved_gb``, per worker group: ``.../<group>``.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Mapping, Sequence

GiB = 1024**3
PEAK_RSS_PREFIX = "perf/peak_rss_gb"
CUDA_ALLOCATED_PREFIX = "perf/max_memory_allocated_gb"  # EasyR1's names (torch.cuda.max_memory_*)
CUDA_RESERVED_PREFIX = "perf/max_memory_reserved_gb"


def peak_rss_bytes() -> int:
    """The most resident memory this process has held since it started, in bytes: the kernel's
    high-water mark of its own address space (Linux: ``VmHWM`` of /proc/self/status; elsewhere
    ``getrusage(RUSAGE_SELF).ru_maxrss``, which on Linux also carries over the parent's resident
    size when a process is forked and exec'd, so a small child of a large parent would report the
    parent's). Children do not count; shared pages (libraries) count in full, as in RSS."""
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
    """``perf/peak_rss_gb/<name>``: GiB (2^30 bytes, as verl's ``perf/max_memory_allocated_gb``) of
    each process's peak. ``peaks``: a process name -> its peak in bytes, or a worker group's name ->
    its ranks' peaks (the largest is logged: the ranks hold equal shares)."""
    out = {}
    for name, value in peaks.items():
        values = [value] if isinstance(value, int) else list(value)
        if values:
            out[f"{PEAK_RSS_PREFIX}/{name}"] = max(values) / GiB
    return out


def cuda_peak_bytes() -> tuple[int, int] | None:
    """(allocated, reserved): the high-water marks, in bytes, of torch's CUDA caching allocator in
    this process on its current device (``torch.cuda.max_memory_allocated`` / ``_reserved``: the
    tensors it held at most, and the memory the allocator took from the driver for them). None
    without CUDA: no device visible, or torch never imported here (a process that does not use
    torch is not made to import it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def cuda_peak_metrics(peaks: Mapping[str, Sequence[tuple[int, int] | None]]) -> dict[str, float]:
    """``perf/max_memory_allocated_gb/<name>`` and ``perf/max_memory_reserved_gb/<name>`` (GiB, as
    EasyR1 logs them) of each worker group's ranks' :func:`cuda_peak_bytes` answers: the largest
    rank's. A group whose ranks have no CUDA (None) gets no keys: absent, not 0."""
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
    """Hand the whole pages of the memory at ``address`` (``nbytes`` long, private anonymous memory:
    a tensor's storage) back to the operating system, keeping the allocation: Linux's
    ``madvise(MADV_DONTNEED)``, after which the range reads as zeros and takes memory again only as
    it is written. Returns the bytes released (0 off Linux)."""
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
    """Return the C heap's free memory to the operating system (glibc's ``malloc_trim(0)``): freed
    activations and temporaries otherwise stay resident, so a phase's peak would add to the next's.
    A no-op where there is no glibc."""
    if sys.platform.startswith("linux"):
        try:
            _libc().malloc_trim(0)
        except AttributeError:  # another C library (musl)
            pass
