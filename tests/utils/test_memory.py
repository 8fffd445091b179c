"""easyvlm.utils.memory: each process's own peak, the metric names and values, and the two ways
memory goes back to the OS (released pages, trimmed heap)."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from easyvlm.utils.memory import (
    GiB,
    cuda_peak_bytes,
    cuda_peak_metrics,
    peak_rss_bytes,
    peak_rss_metrics,
    release_pages,
    trim_heap,
)

MiB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / malloc_trim / statm are Linux's")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _allocate_and_report(size: int, conn) -> None:
    """A worker-like process: its peak before and after writing ``size`` bytes of a tensor."""
    import torch

    before = peak_rss_bytes()
    block = torch.ones(size, dtype=torch.uint8)  # written, so every page is resident
    after = peak_rss_bytes()
    conn.send((before, after, int(block[::4096].sum())))


@linux_only
def test_the_peak_is_the_process_own_and_rises_by_what_it_allocates():
    """A child process writes 384 MiB: its own peak rises by at least that much; this process's
    peak does not. The child is started by fork and exec from this (large) process: its peak starts
    at its own imports, not at this process's size (which Linux's ru_maxrss would report)."""
    size = 384 * MiB
    ballast = b"\x01" * GiB  # written: this process holds over 1 GiB when the child is started  # noqa: F841
    parent_before = peak_rss_bytes()
    ctx = multiprocessing.get_context("spawn")  # a fresh process: its peak starts at its imports
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_allocate_and_report, args=(size, theirs))
    child.start()
    before, after, touched = ours.recv()
    child.join(timeout=60)
    assert touched == size // 4096  # every page of the block holds a 1
    assert after - before >= size  # the child's peak rose by the whole block
    # plausible: a Python process that imported torch holds more than 100 MiB, less than 1 GiB here
    # whatever this process holds (over 1 GiB with the ballast; ru_maxrss would start the child there)
    assert 100 * MiB < before < GiB
    assert peak_rss_bytes() - parent_before < size  # not ours
    # and this process's peak is what it holds now or more (a high-water mark, in bytes: not KiB;
    # 1 MiB of slack for what the interpreter allocates between the two readings)
    assert peak_rss_bytes() >= rss_now() - MiB > 10 * MiB


def test_peak_rss_metrics_names_and_values():
    # GiB = 2^30 bytes; a group logs its largest rank's peak
    metrics = peak_rss_metrics({"driver": 3 * GiB // 2, "hybrid": [GiB, 5 * GiB // 4], "reward": [GiB // 4], "none": []})
    assert metrics == {"perf/peak_rss_gb/driver": 1.5, "perf/peak_rss_gb/hybrid": 1.25, "perf/peak_rss_gb/reward": 0.25}


def test_cuda_peak_metrics_names_and_values():
    # EasyR1's names, per group, GiB of the largest rank's (allocated, reserved); a group whose ranks
    # have no CUDA (None) gets no keys at all
    metrics = cuda_peak_metrics({"hybrid": [(GiB, 2 * GiB), (3 * GiB // 2, 7 * GiB // 4)], "critic": [None, None], "none": []})
    assert metrics == {"perf/max_memory_allocated_gb/hybrid": 1.5, "perf/max_memory_reserved_gb/hybrid": 2.0}


def _cuda_peak_in_a_fresh_process(code: str, **env: str) -> str:
    import os
    import subprocess

    out = subprocess.run([sys.executable, "-c", "from easyvlm.utils.memory import cuda_peak_bytes\n" + code],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_without_cuda_there_is_no_cuda_peak_and_torch_is_not_imported_for_it():
    # a process with torch but no visible device (on any machine: CUDA_VISIBLE_DEVICES empty)
    assert _cuda_peak_in_a_fresh_process("import torch; print(cuda_peak_bytes())", CUDA_VISIBLE_DEVICES="") == "None"
    # a process that never imported torch (the reward actor) answers None and still has not
    assert _cuda_peak_in_a_fresh_process("import sys; print(cuda_peak_bytes(), 'torch' in sys.modules)") == "None False"


@pytest.mark.gpu
def test_cuda_peaks_are_the_allocators_high_water_marks():
    import torch

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    block = torch.ones(256 * MiB, dtype=torch.uint8, device="cuda")
    del block
    allocated, reserved = cuda_peak_bytes()
    assert allocated >= before + 256 * MiB  # the block counts after it was freed: a high-water mark
    assert reserved >= allocated
    assert (allocated, reserved) == (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    metrics = cuda_peak_metrics({"hybrid": [(allocated, reserved)]})
    assert metrics["perf/max_memory_allocated_gb/hybrid"] == allocated / GiB >= 0.25


@linux_only
def test_released_pages_leave_the_process_and_read_as_zeros():
    import torch

    block = torch.ones(256 * MiB, dtype=torch.uint8)
    storage = block.untyped_storage()
    held = rss_now()
    released = release_pages(storage.data_ptr(), storage.nbytes())
    # the whole pages inside the block: all of it but at most one partial page at each end
    assert storage.nbytes() - 2 * 4096 <= released <= storage.nbytes()
    assert held - rss_now() >= released - 4 * MiB  # gone from the resident set (a little slack for the allocator)
    # the allocation stays valid: the released part reads as zeros, the partial end pages keep their ones
    assert int(block.sum()) == storage.nbytes() - released
    block.fill_(2)  # and it can be written again
    assert int(block[::4096].sum()) == 2 * (256 * MiB // 4096)
    assert release_pages(storage.data_ptr(), 0) == 0


@linux_only
def test_trimmed_heap_returns_freed_small_allocations():
    """Many freed 64 KiB buffers (below glibc's mmap threshold: they live in the heap) stay resident
    until the heap is trimmed."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    count, size = 4096, 64 * 1024  # 256 MiB in all
    pointers = []
    for _ in range(count):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        pointers.append(p)
    held = rss_now()
    for p in pointers[:-1]:  # keep the last one: the heap's top stays in use, only trimming returns the rest
        libc.free(p)
    trim_heap()
    assert held - rss_now() >= 200 * MiB
    libc.free(pointers[-1])
