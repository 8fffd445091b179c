"""Seconds and bytes of a weight sync to separate rollout engines, the two paths side by side (issue 58):
the bench model (``builtin:bench-qwen2.5-vl``, ~40 M parameters, fp32) with
``worker.rollout.placement=separate``, synchronous, the weights sent as Ray objects
(``worker.rollout.weight_transfer=object_store``) and by the bucketed broadcast from the actor's rank 0
(``collective``: gloo on the CPU).

    PYTHONPATH=. python bench/weight_transfer.py [--steps 6] [--engines 1] [--threads 1] [--set KEY=VALUE ...]
    PYTHONPATH=. python bench/weight_transfer.py --tiny --steps 2    # the demo's tiny model: does it run

Each path is one training run of the demo config in its own process (``python -m easyvlm.trainer.main``),
object store first, on a short step (4 prompts x 2 samples x 4 tokens, one mini-batch): the sync is what
is measured, not the step. Every step syncs (the weights changed). Reported per path: the median
``timing_s/weight_sync`` (the driver's wall time of the sync: the actor's gather, the transfer and the
engines' load) and ``perf/weight_sync_bytes`` (what one engine took) over steps 2.. (step 1 also
forms the transfer group and warms up; with --steps 1 it is all there is), and the ratio of the
seconds, object store / collective. The last stdout line is one JSON object.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import REPO, cpu_description, example_args  # noqa: E402

BENCH = "builtin:bench-qwen2.5-vl"
PATHS = ("object_store", "collective")
SHORT_STEP = ["data.rollout_batch_size=4", "worker.rollout.n=2", "data.max_response_length=4",
              "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=8",
              "worker.actor.micro_batch_size_per_device_for_experience=8"]


def run(path: str, args: argparse.Namespace, out: Path) -> list[dict]:
    """One training run with ``worker.rollout.weight_transfer=path``; its per-step log rows."""
    model = [] if args.tiny else [f"worker.actor.model.model_path={BENCH}"]
    overrides = example_args(
        *model, *SHORT_STEP, "worker.rollout.placement=separate", f"worker.rollout.num_devices={args.engines}",
        f"worker.rollout.weight_transfer={path}", f"trainer.max_steps={args.steps}", "trainer.val_before_train=false",
        "trainer.val_freq=-1", "trainer.save_freq=-1", "trainer.rollout_log_freq=-1", "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={out}", *args.set)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    with open(out / "run.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "easyvlm.trainer.main", *overrides], env=env, cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"weight_transfer={path}: the run failed ({proc.returncode}); its log's end:\n"
                           + (out / "run.log").read_text()[-3000:])
    return [json.loads(line) for line in (out / "experiment_log.jsonl").read_text().splitlines() if line]


def summary(rows: list[dict]) -> dict:
    """The medians over steps 2.. (all steps if there is one)."""
    timed = rows[1:] or rows
    return {"weight_sync_s": statistics.median(r["timing_s/weight_sync"] for r in timed),
            "weight_sync_bytes": statistics.median(r["perf/weight_sync_bytes"] for r in timed),
            "step_s": statistics.median(r["timing_s/step"] for r in timed), "steps_timed": len(timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engines", type=int, default=1, help="worker.rollout.num_devices")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    parser.add_argument("--tiny", action="store_true", help="the demo config's tiny model instead of the bench model")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    args = parser.parse_args()
    results, start = {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="easyvlm-bench-weight-transfer-") as tmp:
        for path in PATHS:
            out = Path(tmp) / path
            out.mkdir()
            results[path] = summary(run(path, args, out))
            print(f"{path}: {results[path]}", flush=True)
    store, collective = results["object_store"], results["collective"]
    print(json.dumps({
        "bench": "weight_transfer", "model": "tiny (demo config)" if args.tiny else BENCH, "steps": args.steps,
        "engines": args.engines, "threads": args.threads, "overrides": args.set, "cpu": cpu_description(),
        "machine": platform.node(), "object_store": store, "collective": collective,
        "seconds_ratio_object_store_over_collective": store["weight_sync_s"] / collective["weight_sync_s"],
        "same_bytes": store["weight_sync_bytes"] == collective["weight_sync_bytes"],
        "run_s": round(time.perf_counter() - start, 1),
    }))


if __name__ == "__main__":
    main()
