"""Seconds per step and learning of the demo config with the rollout engine and the actor pinned to
disjoint cores: synchronous separate placement vs asynchronous rollout (issue 45).

    PYTHONPATH=. python bench/async_rollout.py --mode k2_partial --steps 300 [--out DIR] [--set KEY=VALUE ...]

One mode per call, in this process (``easyvlm.trainer.main.main``), so that a thread here can ask
Ray where the run's ranks are (``ray.util.state.list_actors``) and pin every thread of the hybrid
rank to core 0 and of the rollout rank to core 1 (``os.sched_setaffinity`` on each task of the
process, again every 2 s for threads made later); the driver and the reward actor float.
OMP_NUM_THREADS=1: one compute thread per rank. Reported: the median ``timing_s/step`` over steps
6.. (warm-up and the pipeline's filling excluded), the medians of the waits, the first step whose
validation accuracy reached 0.9 and its wall time, the last validation accuracy, and the
staleness and partial-fraction means.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

# The asynchronous modes train with the default staleness correction (token-level truncated IS:
# rollout_is=token, issue 55); k2_partial_uncorrected trains the stale samples as if fresh.
MODES = {
    "separate": ["worker.rollout.placement=separate"],
    "k1": ["worker.rollout.placement=separate", "worker.rollout.max_staleness=1"],
    "k2": ["worker.rollout.placement=separate", "worker.rollout.max_staleness=2"],
    "k2_partial": ["worker.rollout.placement=separate", "worker.rollout.max_staleness=2",
                   "worker.rollout.partial_rollout=true"],
    "k2_partial_uncorrected": ["worker.rollout.placement=separate", "worker.rollout.max_staleness=2",
                               "worker.rollout.partial_rollout=true", "worker.rollout.correct_staleness=false"],
}
SKIP = 5
CORES = {"easyvlm-hybrid-0": {0}, "easyvlm-rollout-0": {1}}


def pin_ranks(stop: threading.Event, pinned: dict[str, int]) -> None:
    """Every 2 s: pin each thread of the named ranks' processes to their core."""
    import ray

    while not stop.wait(2.0):
        if not ray.is_initialized():
            continue
        for name, core in CORES.items():
            try:
                pid = pinned.get(name) or ray.get(ray.get_actor(name).pid.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the rank is not started yet
                continue
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), core)
                except OSError:
                    pass
            pinned[name] = pid


def summarise(rows: list[dict], wall: list[float]) -> dict:
    steps = [r for r in rows if r["step"] > SKIP and "timing_s/step" in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return round(statistics.median(values), 3) if values else None

    val = [(r["step"], r["val/accuracy_reward"]) for r in rows if "val/accuracy_reward" in r]
    reached = next(((s, a) for s, a in val if a >= 0.9), None)
    return {
        "median_step_s": median("timing_s/step"),
        "median_wait_rollout_s": median("timing_s/wait_rollout"),
        "median_wait_trainer_s": median("timing_s/wait_trainer"),
        "median_update_actor_s": median("timing_s/update_actor"),
        "staleness_mean": median("rollout/staleness_mean"),
        "staleness_max": max((r.get("rollout/staleness_max", 0) for r in rows), default=None),
        "partial_fraction_mean": round(statistics.mean(r.get("rollout/partial_fraction", 0.0) for r in steps), 4)
        if steps else None,
        "steps_with_partial": sum(1 for r in steps if r.get("rollout/partial_fraction", 0.0) > 0),
        "val": val,
        "first_step_at_0.9": reached[0] if reached else None,
        "wall_s_to_0.9": round(wall[reached[0] - 1], 1) if reached and len(wall) >= reached[0] else None,
        "last_val_accuracy": val[-1][1] if val else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-freq", type=int, default=25)
    parser.add_argument("--out", default="/tmp/easyvlm-async-bench")
    parser.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from easyvlm.trainer.main import main as train

    run_dir = Path(args.out) / args.mode
    overrides = ["config=examples/config.yaml", *MODES[args.mode], f"trainer.max_steps={args.steps}",
                 f"trainer.val_freq={args.val_freq}", "trainer.val_before_train=false", "trainer.save_freq=-1",
                 f"trainer.save_checkpoint_path={run_dir}", *args.set]
    stop, pinned = threading.Event(), {}
    pinner = threading.Thread(target=pin_ranks, args=(stop, pinned), daemon=True)
    pinner.start()
    start = time.perf_counter()
    try:
        train(overrides)
    finally:
        stop.set()
    total = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines()]
    wall = list(itertools.accumulate(r.get("timing_s/step", 0.0) + r.get("timing_s/validation", 0.0) for r in rows))
    result = {"bench": "async_rollout", "mode": args.mode, "steps": args.steps, "overrides": overrides,
              "pinned": pinned, "cpu": platform.processor() or platform.machine(), "run_s": round(total, 1),
              **summarise(rows, wall)}
    print(json.dumps(result))
    (run_dir / "bench_result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
