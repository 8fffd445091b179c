"""Router replay where the sampler and the trainer route differently (issue 54): the demo config on
the Qwen3-VL-MoE demo policy with the CPU's vLLM engine in bf16 (easyvlm runs it in float32) and the
trainer in float32, a few steps with ``worker.actor.router_replay`` disabled, R2 and R3.

    PYTHONPATH=. python bench/router_replay_gap.py [--steps 5] [--modes disabled R2 R3] [--out DIR] [key=value ...]

Each mode runs the trainer in its own process (``easyvlm.trainer.main.run`` on the plan
``plan_run`` builds, with ``EngineSpec.cpu_dtype=bf16``: no config key runs the CPU engine in
another dtype than float32) and reads from its log, per step:

- ``actor/rollout_mismatch/k3``: KL(sampler || trainer) over the response tokens;
- ``actor/moe/routing_mismatch``: the share of the samples' tokens whose experts the trainer's
  routers would choose differ from the batch's record. R3: the sampler's record, replayed.
  disabled: the engine records too (``EngineSpec.record_routing``; a disabled trainer replays
  nothing), so it is the share the trainer routes otherwise than the sampler. R2: the record is the
  old-log-prob pass's (the engine must not record: R2's old pass would replay it), so it is the
  update's drift from that pass, not from the sampler.

Results: a markdown table on stdout and ``<out>/results.json``; the CPU is named
(``bench_support.cpu_description``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_support import REPO, cpu_description, example_args

POLICY = "builtin:tiny-qwen3-vl-moe-synthetic"  # the Qwen3-VL-MoE demo's warm start (docs/benchmarks.md)
K3, MISMATCH = "actor/rollout_mismatch/k3", "actor/moe/routing_mismatch"


def run_one(mode: str, steps: int, out: Path, overrides: list[str]) -> None:
    """One mode's run in this process (the plan changed in memory, so not through the CLI)."""
    from easyvlm.plan.launch import plan_run
    from easyvlm.trainer.main import run

    args = example_args(f"worker.actor.model.model_path={POLICY}", f"worker.actor.router_replay={mode}",
                        "worker.rollout.enforce_eager=true", f"trainer.max_steps={steps}", "trainer.val_freq=-1",
                        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[file]",
                        "trainer.rollout_log_freq=-1", f"trainer.save_checkpoint_path={out}", *overrides)
    plan = plan_run(args)
    # bf16 sampler; the disabled trainer gets the sampler's routing only to measure it (never replayed)
    engine = dataclasses.replace(plan.rollout.engine, cpu_dtype="bf16",
                                 record_routing=plan.rollout.engine.record_routing or mode == "disabled")
    run(dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, engine=engine)))


def summary(mode: str, out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "experiment_log.jsonl").read_text().splitlines() if line.strip()]
    k3 = [row[K3] for row in rows]
    mismatch = [row[MISMATCH] for row in rows if MISMATCH in row]
    return {"mode": mode, "steps": len(rows), "k3": k3, "routing_mismatch": mismatch,
            "step_s": statistics.median(row["timing_s/step"] for row in rows),
            "reward": [row["reward/overall"] for row in rows]}


def span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{min(values):{fmt}} .. {max(values):{fmt}} (mean {statistics.fmean(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["disabled", "R2", "R3"], choices=["disabled", "R2", "R3"])
    parser.add_argument("--out", type=Path, default=None, help="where each mode's run directory goes (default: a temporary one)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one mode in this process
    args, overrides = parser.parse_known_args()
    if args.one is not None:
        run_one(args.one, args.steps, args.out, overrides)
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="easyvlm-r3-gap-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    results = []
    for mode in args.modes:
        out = root / mode
        subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps), "--out", str(out), *overrides],
                       check=True, env=env, cwd=REPO)
        results.append(summary(mode, out))
    (root / "results.json").write_text(json.dumps({"cpu": cpu_description(), "results": results}, indent=1))
    print(f"\n{cpu_description()}; {POLICY}, vLLM bf16, trainer float32, {args.steps} steps; runs in {root}\n")
    print("| `router_replay` | `actor/rollout_mismatch/k3` per step | `actor/moe/routing_mismatch` per step | s/step |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {span(r['k3'], '.2e')} | {span(r['routing_mismatch'], '.3f')} | {r['step_s']:.1f} |")


if __name__ == "__main__":
    main()
