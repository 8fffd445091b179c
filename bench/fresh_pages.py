"""What touching fresh memory costs on this machine: the price of memory a process gives back.

    python bench/fresh_pages.py [--mib 256] [--rounds 4] [--gap 3]

A tensor of ``--mib`` MiB is allocated and filled, then freed, ``--rounds`` times right after the
previous one and ``--rounds`` times after sleeping ``--gap`` seconds; once with 4 KiB pages and once
with transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE=1``, in a child process: torch reads it
once). Prints the median seconds per GiB of each case and the kernel's free-page-reporting counter.

Why: a freed allocation this large goes back to the kernel (glibc unmaps chunks above its mmap
threshold, and ``malloc_trim`` returns the heap's free top), and the next allocation faults its
pages in again. On a VM whose balloon device reports free pages to the host
(``/sys/module/page_reporting``: a 2 MiB free block is handed back after ~2 s), memory that stayed
free that long must also be faulted in again by the host. The development VM: 4 KiB pages ~1 s per
GiB either way; huge pages ~0.1-0.2 s per GiB right after a free, ~4-7 s per GiB once reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def reported_kib() -> int | None:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return None


def measure(mib: int, rounds: int, gap: float) -> dict:
    import torch

    torch.set_num_threads(1)

    def fill_once() -> float:
        start = time.perf_counter()
        x = torch.empty(mib * 2**18)  # float32: mib MiB
        x.fill_(1.0)
        elapsed = time.perf_counter() - start
        del x
        return elapsed * 1024 / mib  # seconds per GiB

    fill_once()  # the first touch of the process's address space
    right_after = [fill_once() for _ in range(rounds)]
    after_gap = []
    for _ in range(rounds):
        time.sleep(gap)
        after_gap.append(fill_once())
    return {"right_after_s_per_gib": statistics.median(right_after), f"after_{gap:g}s_s_per_gib": statistics.median(after_gap)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--gap", type=float, default=3.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.mib, args.rounds, args.gap)))
        return
    before = reported_kib()
    for pages, env in (("4 KiB pages", {}), ("huge pages", {"THP_MEM_ALLOC_ENABLE": "1"})):
        cmd = [sys.executable, __file__, "--child", "--mib", str(args.mib), "--rounds", str(args.rounds), "--gap", str(args.gap)]
        out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
        print(pages, out.strip().splitlines()[-1], flush=True)
    after = reported_kib()
    if before is not None:
        print(f"free page reporting: {(after - before) / 2**20:.2f} GiB handed to the host during the runs")
    else:
        print("no free page reporting on this machine (no /sys/module/page_reporting)")


if __name__ == "__main__":
    main(sys.argv[1:])
