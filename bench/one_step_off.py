"""Step time of the demo config: synchronous (colocated engine) vs one-step-off (separate engine).

    PYTHONPATH=. python bench/one_step_off.py [--steps 40] [--repeats 3] [--threads 1] [--set KEY=VALUE ...]

Each repetition runs ``python -m easyvlm.trainer.main config=examples/config.yaml`` for --steps
steps (no validation, no checkpoints) in each mode, alternating the modes so that a noisy spell of
the shared machine hits both: ``sync`` (the default: one process per rank holds actor and engine),
``separate`` (the engine in its own process, synchronous) and ``one_step_off`` (the next step's
generation overlaps this step's training, token TIS on). Reported per mode: the median over
repetitions of each run's median ``timing_s/step`` (steps 1-5 excluded: engine warm-up and the
first step, which never overlaps), the median ``timing_s/gen`` (one_step_off: the wait for the
prefetched batch) and the last logged reward. --threads sets OMP_NUM_THREADS, i.e. torch's threads
in every rank and engine process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_support import example_args

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "sync": [],
    "separate": ["worker.rollout.placement=separate"],
    "one_step_off": ["worker.rollout.placement=separate", "worker.rollout.one_step_off=true",
                     "algorithm.rollout_correction.rollout_is=token"],
}
SKIP = 5


def run(mode: str, steps: int, threads: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"easyvlm-bench-{mode}-") as out:
        args = example_args(*MODES[mode], f"trainer.max_steps={steps}", "trainer.val_freq=-1",
                            "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[file]",
                            "trainer.rollout_log_freq=-1", f"trainer.save_checkpoint_path={out}", *overrides)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-m", "easyvlm.trainer.main", *args], check=True, env=env, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (Path(out) / "experiment_log.jsonl").read_text().splitlines() if line]
    timed = rows[SKIP:]
    return {
        "step_s": statistics.median(r["timing_s/step"] for r in timed),
        "gen_s": statistics.median(r["timing_s/gen"] for r in timed),
        "gen_async_s": statistics.median(r.get("timing_s/gen_async", 0.0) for r in timed),
        "update_s": statistics.median(r["timing_s/update_actor"] for r in timed),
        "reward": rows[-1]["reward/overall"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable); docs/benchmarks.md's 2026-11-26 figures ran "
                             "the demo config of that day: worker.actor.global_batch_size=32 "
                             "worker.actor.optim.lr=3e-4 worker.actor.optim.lr_scheduler_type=constant")
    opts = parser.parse_args()
    modes = opts.modes.split(",")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for repeat in range(opts.repeats):
        for mode in modes:
            results[mode].append(run(mode, opts.steps, opts.threads, opts.set))
            print(f"repeat {repeat + 1} {mode}: {results[mode][-1]}", flush=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; steps {opts.steps} "
          f"(median over steps {SKIP + 1}-{opts.steps}), repeats {opts.repeats}, OMP_NUM_THREADS={opts.threads}")
    base = statistics.median(r["step_s"] for r in results[modes[0]])
    for mode in modes:
        runs = results[mode]
        steps = [r["step_s"] for r in runs]
        print(f"{mode:13s} step {statistics.median(steps):.3f} s (min {min(steps):.3f}, max {max(steps):.3f}) "
              f"x{base / statistics.median(steps):.2f} vs {modes[0]}; gen/wait {statistics.median(r['gen_s'] for r in runs):.3f} s, "
              f"gen_async {statistics.median(r['gen_async_s'] for r in runs):.3f} s, "
              f"update {statistics.median(r['update_s'] for r in runs):.3f} s")


if __name__ == "__main__":
    main()
