"""What the rollout viewer costs a training step: the demo config with ``trainer.rollout_log_freq=1``
(a page every step: the worst case) against the viewer off, in alternating runs.

    PYTHONPATH=. .venv/bin/python bench/viewer_overhead.py [--steps 20] [--rounds 3]

Each run is a fresh ``python -m easyvlm.trainer.main`` of the demo config for ``--steps`` steps, no
validation; the figure is each variant's median ``timing_s/step`` over all runs' steps 2.. (step 1
warms up), and the ratio on/off. Runs alternate (off, on, off, on, ...) so that a change in the
machine's load hits both variants alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_support import REPO, example_args, matmul_peak


def run(steps: int, freq: int, save: Path) -> list[float]:
    args = example_args(
        f"trainer.max_steps={steps}", "trainer.val_before_train=false", "trainer.val_freq=-1",
        "trainer.logger=[file]", f"trainer.rollout_log_freq={freq}", f"trainer.save_checkpoint_path={save}",
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, "-m", "easyvlm.trainer.main", *args], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (save / "experiment_log.jsonl").read_text().splitlines()]
    if freq > 0:
        assert len(list((save / "rollouts").glob("step_*.html"))) == steps, "the viewer wrote a page per step"
    return [r["timing_s/step"] for r in rows if r["step"] >= 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, fp32 matmul peak {matmul_peak(2) / 1e9:.0f} GFLOP/s (measured now)")
    times: dict[str, list[float]] = {"off": [], "on": []}
    medians: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            for name, freq in (("off", -1), ("on", 1)):
                start = time.time()
                steps = run(opts.steps, freq, Path(tmp) / f"{name}_{r}")
                times[name] += steps
                medians[name].append(statistics.median(steps))
                print(f"round {r + 1} viewer {name:3s}: median step {statistics.median(steps):.3f} s ({time.time() - start:.0f} s run)", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"median step time over {len(times['off'])} steps each: off {off:.3f} s, on {on:.3f} s, on/off {on / off:.4f}")
    print(f"per-run medians: off {[round(m, 3) for m in medians['off']]}, on {[round(m, 3) for m in medians['on']]}")


if __name__ == "__main__":
    main()
