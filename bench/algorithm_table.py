"""The policy-loss catalogue on the demo task: validation accuracy and entropy per method and seed.

    PYTHONPATH=. python bench/algorithm_table.py [--steps 150] [--seeds 1 2] [--methods grpo gmpo ...]
                                                [--out /tmp/easyvlm-algorithms]

Each (method, seed) runs ``python -m easyvlm.trainer.main config=examples/config.yaml`` with the
method's overrides (below: nothing else changes, no method is tuned) for --steps steps, seed S being
``trainer.seed=S data.seed=S worker.rollout.seed=S``, and keeps its ``experiment_log.jsonl`` under
--out/<method>-s<seed>/ (a run whose log already reaches the last step is not run again). Then it
prints one markdown table: ``val/accuracy_reward`` at steps 0, 50, 100 and 150 (the demo validates
every 25 steps) and ``actor/entropy_loss`` (the token-mean entropy of the policy on the step's
samples) at steps 50, 100 and 150, with the command line of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_support import cpu_description, example_args

REPO = Path(__file__).resolve().parents[1]
METHODS: dict[str, list[str]] = {
    "GRPO (default)": [],
    "GMPO": ["worker.actor.loss_type=geo_mean"],
    "Clip-Cov": ["worker.actor.loss_type=clip_cov"],
    "KL-Cov": ["worker.actor.loss_type=kl_cov"],
    "GPG": ["worker.actor.loss_type=gpg", "algorithm.adv_estimator=gpg"],
    "80/20": ["worker.actor.top_entropy_quantile=0.2"],
}
SLUGS = {name: name.split(" ")[0].lower().replace("/", "-") for name in METHODS}
REPORTED_STEPS = (50, 100, 150)


def seed_overrides(seed: int) -> list[str]:
    return [f"trainer.seed={seed}", f"data.seed={seed}", f"worker.rollout.seed={seed}"]


def read_log(path: Path) -> dict[int, dict]:
    """step -> the merged metrics logged at that step (training and validation rows)."""
    rows: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows.setdefault(int(row.get("step", row.get("training/global_step", 0))), {}).update(row)
    return rows


def run(method: str, seed: int, steps: int, out: Path, extra: list[str]) -> Path:
    run_dir = out / f"{SLUGS[method]}-s{seed}"
    log = run_dir / "experiment_log.jsonl"
    if steps in read_log(log):
        return log
    overrides = [*METHODS[method], *seed_overrides(seed), f"trainer.max_steps={steps}", "trainer.save_freq=-1",
                 "trainer.logger=[file]", "trainer.rollout_log_freq=-1", f"trainer.save_checkpoint_path={run_dir}", *extra]
    started = time.monotonic()
    print(f"{method} seed {seed}: {' '.join(overrides[:len(METHODS[method]) + 3])}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out / f"{SLUGS[method]}-s{seed}.out", "w") as console:
        subprocess.run([sys.executable, "-m", "easyvlm.trainer.main", *example_args(*overrides)], check=True, env=env,
                       cwd=REPO, stdout=console, stderr=subprocess.STDOUT)
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)
    return log


def table(out: Path, seeds: list[int], methods: list[str]) -> str:
    head = ["method", "seed", "val acc 0", *(f"val acc {s}" for s in REPORTED_STEPS),
            *(f"entropy {s}" for s in REPORTED_STEPS), "overrides (+ seed S: trainer.seed, data.seed, worker.rollout.seed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in methods:
        for seed in seeds:
            rows = read_log(out / f"{SLUGS[method]}-s{seed}" / "experiment_log.jsonl")

            def value(step: int, key: str) -> str:
                return f"{rows[step][key]:.3f}" if key in rows.get(step, {}) else "-"

            cells = [method, str(seed), value(0, "val/accuracy_reward"),
                     *(value(s, "val/accuracy_reward") for s in REPORTED_STEPS),
                     *(value(s, "actor/entropy_loss") for s in REPORTED_STEPS),
                     " ".join(f"`{o}`" for o in METHODS[method]) or "(none)"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--methods", nargs="+", default=list(SLUGS.values()), choices=list(SLUGS.values()))
    parser.add_argument("--out", type=Path, default=Path("/tmp/easyvlm-algorithms"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable), e.g. worker.actor.global_batch_size=32 "
                             "for the one-mini-batch demo of docs/algorithms.md's table")
    parser.add_argument("--table-only", action="store_true", help="print the table of the logs already under --out")
    args = parser.parse_args()
    methods = [m for m in METHODS if SLUGS[m] in args.methods]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for seed in args.seeds:
            for method in methods:
                run(method, seed, args.steps, args.out, args.set)
    print(f"CPU: {cpu_description()}, {os.cpu_count()} CPUs")
    print(table(args.out, args.seeds, methods))


if __name__ == "__main__":
    main()
