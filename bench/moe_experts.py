"""MoE experts on the CPU, side by side in one run: the bench MoE model's (builtin:bench-qwen3-vl-moe:
16 experts of 1024, top-2, hidden 512, 8 layers) update and log-prob passes with its experts as
grouped products (``worker.actor.model.experts_implementation=grouped_mm``, the default) and as
transformers' eager loop (``eager``), and the dense twin of the same active parameters
(builtin:bench-qwen3-vl: one MLP of 2048 per layer).

    PYTHONPATH=. python bench/moe_experts.py [--rounds 3] [--prompts 8] [--n 4] [--response-length 32]
        [--image-size 224] [--steps 3] [--arms grouped eager dense] [--json out.json]

Each arm is one ``bench/gpu_step.py --cpu`` run (its own process: the trainer's hybrid worker, the
demo's config, one micro-batch of every sample, the transformers engine), the arms alternating within
each of ``--rounds`` rounds so that a slow spell of the shared machine falls on all of them. The
figures: per arm, the median over rounds of each run's mean over its steps after the first (warm-up),
and the ratios of the medians. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import cpu_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "grouped": ("bench-qwen3-vl-moe", ["worker.actor.model.experts_implementation=grouped_mm"]),
    "eager": ("bench-qwen3-vl-moe", ["worker.actor.model.experts_implementation=eager"]),
    "dense": ("bench-qwen3-vl", []),
}
PHASES = ("update_s", "old_logprobs_s", "ref_logprobs_s", "generation_s")


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    shape, overrides = ARMS[arm]
    command = [sys.executable, str(REPO / "bench" / "gpu_step.py"), "--cpu", "--shape", shape, "--no-profile",
               "--rollout", "hf", "--prompts", str(args.prompts), "--n", str(args.n), "--response-length",
               str(args.response_length), "--image-size", str(args.image_size), "--steps", str(args.steps), *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{arm}: gpu_step.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    return {phase: statistics.median(run[phase] for run in runs) for phase in PHASES} | {
        "update_mfu": statistics.median(run["update_mfu"] for run in runs)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for round_ in range(args.rounds):
        for arm in args.arms:
            runs[arm].append(run_arm(arm, args))
            print(f"round {round_ + 1} {arm}: " + ", ".join(f"{p} {runs[arm][-1][p]:.2f}" for p in PHASES), flush=True)
    result = {"bench": "moe_experts", "cpu": cpu_description(), "args": vars(args),
              "medians": {arm: medians(r) for arm, r in runs.items()}, "runs": runs}
    m = result["medians"]
    print(f"\n{'arm':<10}" + "".join(f"{p:>16}" for p in PHASES) + f"{'update MFU':>12}")
    for arm, row in m.items():
        print(f"{arm:<10}" + "".join(f"{row[p]:>16.2f}" for p in PHASES) + f"{row['update_mfu']:>12.1%}")
    if "grouped" in m and "eager" in m:
        result["eager_over_grouped"] = {p: m["eager"][p] / m["grouped"][p] for p in PHASES}
    if "grouped" in m and "dense" in m:
        result["grouped_over_dense"] = {p: m["grouped"][p] / m["dense"][p] for p in PHASES}
    for key in ("eager_over_grouped", "grouped_over_dense"):
        if key in result:
            print(f"{key}: " + ", ".join(f"{p} {v:.2f}x" for p, v in result[key].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return result


if __name__ == "__main__":
    main()
