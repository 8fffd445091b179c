"""Peak memory of a command's whole process tree (driver, Ray's processes, workers), per process.

    PYTHONPATH=. python bench/process_tree_memory.py [--interval 0.2] [--json out.json] -- CMD ARGS...
    # e.g. the demo, capped:
    PYTHONPATH=. python bench/process_tree_memory.py -- .venv/bin/python -m easyvlm.trainer.main \
        config=examples/config.yaml trainer.max_steps=10

Runs CMD and samples every process of its tree (CMD and all its descendants: Ray's GCS, raylet
and agents are children of the driver, Ray's workers children of the raylet): the RSS of each from
/proc/<pid>/statm every --interval seconds, and RSS, PSS and USS from /proc/<pid>/smaps_rollup every
--pss-every samples and whenever the RSS sum reaches a new high (reading smaps_rollup makes the
kernel walk the page tables: tens of ms for a GiB-sized process, too costly 5 times a second on 2
cores):

- **RSS**: resident pages of the process, shared ones included. Summed over a tree it counts a page
  that several processes map (torch's and vLLM's libraries, Python's own code) once per process:
  what ``bench/vs_trl.py`` reports (``TreeMemory``), an upper bound.
- **PSS** (proportional set size): a page shared by k processes counts 1/k in each, so the sum over
  the tree is the memory the tree really holds (shared library pages counted once). This is the
  figure to read for "how much RAM does a run need".
- **USS**: pages only this process maps (what killing it would free).

Reported at the end (stdout, and ``--json``): the peak of the tree's RSS sum and of its PSS sum,
each process's own peaks, the per-process breakdown at the moment of the PSS peak (the JSON also
has the sums' timeline and every process's RSS once a second), with a role read from the process's
title (Ray names its actors ``ray::ClassName...``): driver, hybrid worker
(``_RankHost``: the FSDP actor, the reference model and the vLLM engine of one rank), reward actor,
idle Ray workers, raylet, gcs_server, Ray's agents, the reward actor's child processes, ...
The exit status is CMD's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

GiB = 1024**3
PAGE_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss"}
PAGE = os.sysconf("SC_PAGE_SIZE")


def read_rss(pid: int) -> int | None:
    """Resident bytes of ``pid`` from /proc/<pid>/statm (cheap); None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return None


def read_memory(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS (bytes) of ``pid`` from /proc/<pid>/smaps_rollup (the kernel walks the
    process's page tables: ~20-80 ms for a 1-4 GiB process here); None if it is gone."""
    out = {"rss": 0, "pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                key = PAGE_FIELDS.get(parts[0]) if parts else None
                if key:
                    out[key] += int(parts[1]) * 1024  # kB
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return out


def role(cmdline: list[str], name: str, is_root: bool) -> str:
    """A short role for a process of an easyvlm run, from its title / command line. Ray retitles a
    worker process ``ray::ClassName.method`` once it hosts an actor (``ray::IDLE`` before)."""
    if is_root:
        return "driver"
    title = " ".join(cmdline) if cmdline else name
    exe = os.path.basename(cmdline[0]) if cmdline else name
    if title.startswith("ray::"):
        actor = title[len("ray::"):].split()[0].split(".")[0].split(":")[-1]  # ray::<actor name>:<class> at first
        for prefix, label in (  # a title may be cut short (ray::DashboardA)
            ("_RankHost", "worker (_RankHost)"),
            ("RewardActor", "reward actor"),
            ("JudgeActor", "judge actor"),
            ("IDLE", "ray idle worker"),
            ("DashboardA", "ray dashboard agent"),
            ("RuntimeEnvA", "ray runtime_env agent"),
        ):
            if actor.startswith(prefix):
                return label
        return f"ray::{actor}"
    if exe in ("raylet", "gcs_server"):
        return f"ray {exe}"
    for key, label in (
        ("default_worker.py", "ray worker (starting)"),
        ("log_monitor.py", "ray log_monitor"),
        ("autoscaler/_private/monitor.py", "ray autoscaler monitor"),
        ("dashboard/dashboard.py", "ray dashboard (API server)"),
        ("dashboard/agent.py", "ray dashboard agent"),
        ("runtime_env/agent", "ray runtime_env agent"),
    ):
        if key in title:
            return label
    return f"other ({name}: {title[:60]})"


@dataclass
class TreeSampler:
    """Samples ``pid`` and its descendants in a thread: RSS of every process every ``interval``
    seconds (/proc/<pid>/statm, cheap); PSS and USS (smaps_rollup, which costs tens of ms for a
    large process and would slow a run on 2 cores if read 5 times a second) every ``pss_every``-th
    sample and at every sample whose RSS sum sets a new high; never with ``pss_every=0``."""

    pid: int
    interval: float = 0.2
    pss_every: int = 5
    peak_rss_sum: int = 0
    peak_rss_at: float = 0.0
    peak_pss_sum: int = 0
    peak_pss_at: float = 0.0
    breakdown_at_peak: list[dict] = field(default_factory=list)
    per_process: dict[int, dict] = field(default_factory=dict)
    samples: int = 0
    timeline: list[tuple[float, int, int | None]] = field(default_factory=list)  # (s, RSS sum, PSS sum or None)
    process_timeline: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # (s, {pid: RSS}), every pss_every-th

    def __post_init__(self) -> None:
        import psutil

        self._root = psutil.Process(self.pid)
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _info(self, proc) -> dict:
        import psutil

        info = self.per_process.get(proc.pid)
        if info is None:
            info = self.per_process[proc.pid] = {"pid": proc.pid, "role": "?", "peak_rss": 0, "peak_pss": 0, "peak_uss": 0}
        if not info["role"].startswith(("driver", "worker", "reward", "judge", "ray raylet", "ray gcs")):
            try:  # Ray retitles a worker when it becomes an actor: read again until it is settled
                info["role"] = role(proc.cmdline(), proc.name(), proc.pid == self.pid)
            except psutil.Error:
                pass
        return info

    def sample(self) -> None:
        import psutil

        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return
        now = time.perf_counter() - self._start
        rss = {p.pid: r for p in procs if (r := read_rss(p.pid)) is not None}
        rss_sum = sum(rss.values())
        for proc in procs:
            if proc.pid in rss:
                info = self._info(proc)
                info["peak_rss"] = max(info["peak_rss"], rss[proc.pid])
        self.samples += 1
        every = self.pss_every or 5  # the per-process timeline's period, PSS or not
        if self.samples % every == 1:
            self.process_timeline.append((round(now, 2), rss))
        pss_sum = None
        if self.pss_every and (rss_sum > self.peak_rss_sum or self.samples % self.pss_every == 1):
            rows, pss_sum = [], 0
            for proc in procs:
                mem = read_memory(proc.pid)
                if mem is None:
                    continue
                info = self._info(proc)
                for key in ("rss", "pss", "uss"):
                    info[f"peak_{key}"] = max(info[f"peak_{key}"], mem[key])
                pss_sum += mem["pss"]
                rows.append({"pid": proc.pid, "role": info["role"], **mem})
            if pss_sum > self.peak_pss_sum:
                self.peak_pss_sum, self.peak_pss_at, self.breakdown_at_peak = pss_sum, now, rows
        if rss_sum > self.peak_rss_sum:
            self.peak_rss_sum, self.peak_rss_at = rss_sum, now
        self.timeline.append((round(now, 2), rss_sum, pss_sum))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        by_role: dict[str, dict] = {}
        for row in self.breakdown_at_peak:
            agg = by_role.setdefault(row["role"], {"count": 0, "rss_gib": 0.0, "pss_gib": 0.0, "uss_gib": 0.0})
            agg["count"] += 1
            for key in ("rss", "pss", "uss"):
                agg[f"{key}_gib"] += row[key] / GiB
        by_role = {k: {**v, **{m: round(v[m], 3) for m in ("rss_gib", "pss_gib", "uss_gib")}}
                   for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]["pss_gib"])}
        processes = sorted(self.per_process.values(), key=lambda p: -p["peak_pss"])
        return {
            "peak_rss_sum_gib": round(self.peak_rss_sum / GiB, 3),
            "peak_rss_at_s": round(self.peak_rss_at, 1),
            "peak_pss_sum_gib": round(self.peak_pss_sum / GiB, 3),
            "peak_pss_at_s": round(self.peak_pss_at, 1),
            "sum_of_process_peak_rss_gib": round(sum(p["peak_rss"] for p in processes) / GiB, 3),
            "samples": self.samples,
            "at_pss_peak_by_role": by_role,
            "process_peaks": [{"pid": p["pid"], "role": p["role"], **{f"peak_{k}_gib": round(p[f"peak_{k}"] / GiB, 3)
                                                                      for k in ("rss", "pss", "uss")}} for p in processes],
        }


def print_report(rep: dict) -> None:
    print(f"\npeak of the tree: RSS sum {rep['peak_rss_sum_gib']:.2f} GiB (at {rep['peak_rss_at_s']} s), "
          f"PSS sum {rep['peak_pss_sum_gib']:.2f} GiB (at {rep['peak_pss_at_s']} s); {rep['samples']} samples")
    print("\nat the PSS peak, by role:")
    print(f"  {'role':<40}{'n':>3}{'RSS GiB':>9}{'PSS GiB':>9}{'USS GiB':>9}")
    for name, agg in rep["at_pss_peak_by_role"].items():
        print(f"  {name:<40}{agg['count']:>3}{agg['rss_gib']:>9.3f}{agg['pss_gib']:>9.3f}{agg['uss_gib']:>9.3f}")
    print("\neach process's own peaks:")
    for p in rep["process_peaks"]:
        print(f"  {p['pid']:>8} {p['role']:<40}RSS {p['peak_rss_gib']:.3f}  PSS {p['peak_pss_gib']:.3f}  USS {p['peak_uss_gib']:.3f}")


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--pss-every", type=int, default=5, help="read PSS/USS every this many samples (and at RSS highs)")
    parser.add_argument("--json", help="write the report (and the timeline) here")
    parser.add_argument("--log", help="CMD's stdout and stderr go here (default: inherited)")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1:]
    log = open(args.log, "w") if args.log else None
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    with TreeSampler(proc.pid, args.interval, args.pss_every) as sampler:
        code = proc.wait()
    rep = sampler.report()
    rep.update(command=cmd, wall_s=round(time.perf_counter() - start, 1), returncode=code)
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**rep, "timeline": sampler.timeline, "process_timeline": sampler.process_timeline}, f)
    print(json.dumps({k: rep[k] for k in ("peak_rss_sum_gib", "peak_pss_sum_gib", "sum_of_process_peak_rss_gib", "wall_s", "returncode")}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
