"""easyvlm vs TRL's GRPOTrainer on the same GRPO work, side by side in one run; where easyvlm's
step time goes; how it scales; its overhead.

    PYTHONPATH=. python bench/vs_trl.py [--mode compare] [--threads 2] [--steps 3] [--repeats 1] [--pss]
    PYTHONPATH=. python bench/vs_trl.py --mode breakdown   # bench model: timing_s/*, padding-free, old log-probs
    PYTHONPATH=. python bench/vs_trl.py --mode scaling     # step time vs prompts per step and response length
    PYTHONPATH=. python bench/vs_trl.py --mode overhead    # the demo config: step time outside compute

Every training run is its own process (easyvlm: ``python -m easyvlm.trainer.main`` with Ray;
TRL: bench/trl_grpo.py), watched by a sampler of the resident memory (RSS) of its whole process tree
(``--pss`` adds PSS, whose page-table walks cost the timed run ~10% on 2 cores).
Both frameworks get the same model (an EOS-free copy, see ``bench_support.eos_free_model``: every
response runs to the maximum length), the same synthetic prompts and images in file order, the same
prompts per step, samples per prompt, response length, AdamW settings, learning rate and clipping,
no KL (TRL's default beta = 0), one PPO epoch, float32, no gradient checkpointing, and the same
torch threads. The first step of each run is a warm-up; the others are timed (median).

compare (the default) runs the tiny demo model (16 prompts x 8 samples x 8 tokens) and the
bench model (16 x 8 x 128), easyvlm first, and measures the fp32 matmul peak (2048 x 2048,
median of 10) before and after. Its last stdout line is one JSON object for the bench model:
{"easyvlm_s_per_step", "trl_s_per_step", "speedup", "efficiency", ...}, where efficiency =
(essential FLOPs of a step / matmul peak) / easyvlm's median step time (``essential_flops``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import (  # noqa: E402
    TreeMemory,
    bench_plan,
    cpu_description,
    eos_free_model,
    essential_flops,
    example_args,
    fit_exponent,
    machine_matmul_peak,
    model_params,
)

TINY = "builtin:tiny-qwen2.5-vl-synthetic"  # the demo's model
BENCH = "builtin:bench-qwen2.5-vl"
# Both frameworks' prompts: the built-in synthetic train split (TRL's side: trl_grpo.py, which reads
# materialize_dataset("train")), not the demo config's colour-only split.
DATA = "builtin:synthetic@train"
GiB = 1024**3


def easyvlm_overrides(model_dir: str, prompts: int, n: int, max_response: int, steps: int, lr: float, micro: int,
                      out_dir: str) -> list[str]:
    """examples/config.yaml with the benchmark's settings (see the module docstring)."""
    return [
        f"config={REPO / 'examples' / 'config.yaml'}",
        f"worker.actor.model.model_path={model_dir}",
        f"data.train_files={DATA}",
        f"data.rollout_batch_size={prompts}",
        f"data.max_response_length={max_response}",
        "data.shuffle=false",
        f"worker.rollout.n={n}",
        f"worker.rollout.max_num_seqs={prompts * n}",
        # vLLM's default (and EasyR1's): its model compiled; the demo config keeps eager mode for its quick start
        "worker.rollout.enforce_eager=false",
        f"worker.actor.global_batch_size={prompts}",  # one mini-batch: on-policy, old log-probs skipped
        f"worker.actor.micro_batch_size_per_device_for_update={micro}",
        f"worker.actor.micro_batch_size_per_device_for_experience={micro}",
        # `micro` sequences per pass, as TRL's per-device batch: dynamic batching's default budget
        # (EasyR1's, micro x (max_prompt_length + max_response_length) = micro x 384 tokens) would
        # pack ~2x as many of the bench's ~200-token sequences
        "worker.actor.dynamic_batching=false",
        "worker.actor.model.enable_gradient_checkpointing=false",
        "worker.actor.loss_avg_mode=token",
        "worker.actor.entropy_coeff=0",  # TRL has no entropy bonus (the demo config has one)
        "worker.actor.max_grad_norm=1.0",
        f"worker.actor.optim.lr={lr}",
        "worker.actor.optim.weight_decay=0.01",
        "worker.actor.optim.lr_scheduler_type=constant",
        "algorithm.disable_kl=true",
        "algorithm.use_kl_loss=false",
        f"trainer.max_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=-1",
        "trainer.find_last_checkpoint=false",
        "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={out_dir}",
    ]


def _env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def _watch(cmd: list[str], threads: int, log_path: Path, timeout: float, pss: bool = False) -> tuple[float, TreeMemory]:
    """Run ``cmd``; returns its wall time and the memory sampler of its process tree (RSS; PSS too
    with ``pss``, which slows the run: see ``--pss``)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # its own process group, so that a failure here (a timeout, Ctrl-C, the sampler) ends the
        # whole run rather than leaving a training behind to slow the next measurement
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(threads), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            with TreeMemory(proc.pid, pss=pss) as memory:
                proc.wait(timeout=timeout)
        except BaseException as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise RuntimeError(f"{cmd[:4]} ran over {timeout:.0f} s; log: {log_path}") from exc
            raise
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}); log {log_path}:\n{tail}")
    return time.perf_counter() - start, memory


def run_easyvlm(model_dir: str, args, max_response: int, prompts: int | None = None, extra: list[str] = (),
                steps: int | None = None, timeline: bool = False) -> dict:
    """One easyvlm training run in its own process; per-step metrics from its JSONL log."""
    prompts = prompts or args.prompts
    steps = steps or args.steps
    out_dir = tempfile.mkdtemp(prefix="easyvlm-bench-")
    overrides = [*easyvlm_overrides(model_dir, prompts, args.n, max_response, steps, args.lr, args.micro, out_dir), *extra]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--easyvlm-driver", out_dir, "--", *overrides]
    if not timeline:
        cmd = [sys.executable, "-m", "easyvlm.trainer.main", *overrides]
    wall, memory = _watch(cmd, args.threads, Path(out_dir) / "run.log", args.timeout, args.pss)
    rows = [json.loads(line) for line in (Path(out_dir) / "experiment_log.jsonl").read_text().splitlines() if line.strip()]
    result = {
        "framework": "easyvlm",
        "wall_s": wall,
        "step_s": [row["timing_s/step"] for row in rows],
        "rows": rows,
        "peak_rss_gib": memory.peak_sum / GiB,
        "peak_pss_gib": memory.peak_pss_sum / GiB if args.pss else None,
        "sum_of_peak_rss_gib": memory.sum_of_peaks / GiB,
        "response_length": [row["response_length/mean"] for row in rows],
        "out_dir": out_dir,
    }
    if timeline:
        result["worker_exec"] = json.loads((Path(out_dir) / "worker_exec.json").read_text())
    return result


def run_trl(model_dir: str, args, max_response: int) -> dict:
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    cmd = [
        sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--model", model_dir, "--prompts", str(args.prompts),
        "--n", str(args.n), "--max-response", str(max_response), "--steps", str(args.steps), "--lr", str(args.lr),
        "--micro", str(args.micro), "--threads", str(args.threads),
    ]
    wall, memory = _watch(cmd, args.threads, Path(out_dir) / "run.log", args.timeout, args.pss)
    lines = [line for line in (Path(out_dir) / "run.log").read_text().splitlines() if line.startswith('{"framework": "trl"')]
    result = json.loads(lines[-1])
    result.update(wall_s=wall, peak_rss_gib=memory.peak_sum / GiB, peak_pss_gib=memory.peak_pss_sum / GiB if args.pss else None,
                  sum_of_peak_rss_gib=memory.sum_of_peaks / GiB)
    result["response_length"] = result.pop("completion_mean_length")
    return result


def combine_runs(runs: list[dict]) -> dict:
    """One row for several runs of the same framework and model: the median run's figures (by
    s/step; of an even number of runs, the faster of the two middle ones, so that every figure of
    the row is one run's), plus every run's s/step, generation time and peak memory, and the
    spread of the step time (slowest / fastest run)."""
    ordered = sorted(runs, key=lambda r: r["s_per_step"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    steps = [r["s_per_step"] for r in runs]
    row.update(s_per_step=statistics.median_low(steps), s_per_step_runs=steps,
               step_spread=round(max(steps) / min(steps), 3), peak_rss_gib_runs=[r["peak_rss_gib"] for r in runs])
    if all("timing_s" in r for r in runs):
        row["gen_s_runs"] = [r["timing_s"].get("gen") for r in runs]
    return row


def timed_median(values: list[float]) -> float:
    """Median over the steps after the first (warm-up)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def prompt_shapes(model_dir: str, count: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, vision patches) of the first ``count`` training prompts, as easyvlm encodes
    them (the plan's data settings, tokenizer and processor)."""
    from easyvlm.data.dataset import RLDataset

    plan = bench_plan(example_args(f"worker.actor.model.model_path={model_dir}", f"data.train_files={DATA}"))
    data, bundle = plan.data, plan.bundle
    dataset = RLDataset(data.train_files, data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config)
    tokens, patches = [], []
    for i in range(count):
        item = dataset[i]
        tokens.append(len(item["raw_prompt_ids"]))
        grid = item["multi_modal_inputs"].get("image_grid_thw")
        patches.append(int(grid.prod(-1).sum()) if grid is not None else 0)
    return tokens, patches


def summarize(name: str, res: dict, gen_tokens: int) -> dict:
    s = timed_median(res["step_s"])
    return {
        "framework": res["framework"],
        "model": name,
        "s_per_step": round(s, 3),
        "steps_s": [round(x, 3) for x in res["step_s"]],
        "gen_tokens_per_s": round(gen_tokens / s, 1),
        "peak_rss_gib": round(res["peak_rss_gib"], 2),
        "peak_pss_gib": round(res["peak_pss_gib"], 2) if res["peak_pss_gib"] is not None else None,
        "sum_of_peak_rss_gib": round(res["sum_of_peak_rss_gib"], 2),
        "response_length": res["response_length"],
        "wall_s": round(res["wall_s"], 1),
    }


# ------------------------------------------------------------------------------------------------ modes
def mode_compare(args) -> None:
    peaks = [machine_matmul_peak(args.threads)]
    print(f"CPU: {cpu_description()}\nfp32 matmul peak ({args.threads} threads): {_peak_line(peaks[0])}", flush=True)
    rows, results = [], {}
    for label, model, max_response in (("tiny", TINY, args.tiny_response), ("bench", BENCH, args.max_response)):
        if label not in args.models.split(","):
            continue
        model_dir = eos_free_model(model)
        gen_tokens = args.prompts * args.n * max_response
        runs: dict[str, list[dict]] = {"easyvlm": [], "trl": []}
        for _ in range(args.repeats):  # alternated, so a slow hour of the machine hits both sides
            for runner in (run_easyvlm, run_trl):
                res = runner(model_dir, args, max_response)
                row = summarize(label, res, gen_tokens)
                if res["framework"] == "easyvlm":
                    row["timing_s"] = _timing_table(res["rows"])
                print(json.dumps(row), flush=True)
                runs[res["framework"]].append(row)
        for framework, framework_runs in runs.items():
            row = combine_runs(framework_runs)
            rows.append(row)
            results[(label, framework)] = row
        params = model_params(model_dir)
        tokens, patches = prompt_shapes(model_dir, args.prompts * args.steps)
        per_step = [essential_flops(params, tokens[i : i + args.prompts], patches[i : i + args.prompts], args.n, max_response)
                    for i in range(args.prompts, len(tokens), args.prompts)]  # the timed steps' prompts
        results[(label, "flops")] = {k: statistics.mean(f[k] for f in per_step) for k in per_step[0]}
        results[(label, "params")] = params
    peaks.append(machine_matmul_peak(args.threads))
    peak = statistics.median(p["peak"] for p in peaks)
    print(f"fp32 matmul peak after the runs: {_peak_line(peaks[-1])}; used: {peak / 1e9:.1f} GFLOP/s")
    print("\n| model | framework | s/step (median) | generated tokens/s | peak RSS GiB (tree) | efficiency |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        flops = results[(row["model"], "flops")]["total"]
        row["efficiency"] = round(flops / peak / row["s_per_step"], 3)
        print(f"| {row['model']} | {row['framework']} | {row['s_per_step']:.2f} | {row['gen_tokens_per_s']:,.0f} | "
              f"{row['peak_rss_gib']:.2f} | {row['efficiency']:.2f} |")
    out = {"bench": "vs_trl", "cpu": cpu_description(), "threads": args.threads, "matmul_peak_gflops": round(peak / 1e9, 1),
           "matmul_peaks_gflops": [{k: round(v / 1e9, 1) for k, v in p.items()} for p in peaks]}
    models = out["models"] = {}
    for label in ("tiny", "bench"):
        if (label, "easyvlm") not in results:
            continue
        e, t = results[(label, "easyvlm")], results[(label, "trl")]
        p = results[(label, "params")]
        models[label] = {
            "easyvlm": e, "trl": t, "speedup": round(t["s_per_step"] / e["s_per_step"], 3),
            "essential_gflop": {k: round(v / 1e9, 1) for k, v in results[(label, "flops")].items()},
            "params": {"total": p.total, "decoder": p.decoder, "vision": p.vision},
        }
    print(json.dumps(out))
    key = "bench" if "bench" in models else "tiny"
    e, t = models[key]["easyvlm"], models[key]["trl"]
    print(json.dumps({
        "easyvlm_s_per_step": e["s_per_step"], "trl_s_per_step": t["s_per_step"], "speedup": models[key]["speedup"],
        "efficiency": e["efficiency"], "trl_efficiency": t["efficiency"], "model": key,
        "easyvlm_gen_tokens_per_s": e["gen_tokens_per_s"], "trl_gen_tokens_per_s": t["gen_tokens_per_s"],
        "easyvlm_peak_rss_gib": e["peak_rss_gib"], "trl_peak_rss_gib": t["peak_rss_gib"],
        "easyvlm_peak_pss_gib": e["peak_pss_gib"], "trl_peak_pss_gib": t["peak_pss_gib"],
        "repeats": args.repeats, "easyvlm_s_per_step_runs": e["s_per_step_runs"], "trl_s_per_step_runs": t["s_per_step_runs"],
        "easyvlm_step_spread": e["step_spread"], "trl_step_spread": t["step_spread"],
        "easyvlm_gen_s_runs": e.get("gen_s_runs"),
        "matmul_peak_gflops": out["matmul_peak_gflops"], "essential_gflop": models[key]["essential_gflop"]["total"],
        # with shared prompts easyvlm executes fewer FLOPs than the essential count: its efficiency
        # on the FLOPs it runs (prefill + decode + training with each prompt once per group)
        "easyvlm_executed_efficiency": round(_executed_gflop(models[key]) / out["matmul_peak_gflops"] / e["s_per_step"], 3),
        "threads": args.threads,
        **({"tiny_speedup": models["tiny"]["speedup"]} if "tiny" in models and key != "tiny" else {}),
    }))


def _peak_line(peaks: dict[str, float]) -> str:
    kernels = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items() if k != "peak")
    return f"{peaks['peak'] / 1e9:.1f} GFLOP/s (the faster of: {kernels})"


def _executed_gflop(model: dict) -> float:
    flops = model["essential_gflop"]
    return flops["prefill"] + flops["decode"] + flops["train_shared_prompts"]


def _timing_table(rows: list[dict]) -> dict[str, float]:
    """Median over the timed steps of every ``timing_s/*`` metric, named without the prefix."""
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    return {k[len("timing_s/"):]: round(timed_median([r[k] for r in rows if k in r]), 3) for k in keys}


def mode_breakdown(args) -> None:
    """Bench model, easyvlm only: timing_s/* of the default run, padded instead of padding-free,
    and two mini-batches (old log-probs computed) for their cost; worker-side execution times."""
    model_dir = eos_free_model(BENCH)
    variants = {
        "default (padding-free, old log-probs skipped)": ([], ["generate", "update_actor"]),
        "padded (padding_free=false)": (["worker.actor.padding_free=false", "worker.actor.dynamic_batching=false"],
                                        ["generate", "update_actor"]),
        "shared prompts off (share_prompts=false)": (["worker.actor.share_prompts=false"], ["generate", "update_actor"]),
        "old log-probs computed (2 mini-batches)": ([f"worker.actor.global_batch_size={args.prompts // 2}"],
                                                    ["generate", "compute_logprobs", "update_actor"]),
    }
    out = {}
    for name, (extra, methods) in variants.items():
        res = run_easyvlm(model_dir, args, args.max_response, extra=extra, timeline=True)
        table = _timing_table(res["rows"])
        table.update(_exec_table(res, methods))
        out[name] = table
        print(json.dumps({"variant": name, "timing_s": table, "peak_rss_gib": round(res["peak_rss_gib"], 2)}), flush=True)
    print(json.dumps({"bench": "vs_trl_breakdown", "threads": args.threads, "results": out}))


def mode_scaling(args) -> None:
    """easyvlm's median step time against prompts per step and against the response length."""
    model_dir = eos_free_model(args.scaling_model)
    results = {"prompts": {}, "response": {}}
    for prompts in (8, 16, 32, 64):
        res = run_easyvlm(model_dir, args, args.scaling_response, prompts=prompts)
        results["prompts"][prompts] = round(timed_median(res["step_s"]), 3)
        print(json.dumps({"prompts": prompts, "max_response": args.scaling_response, "s_per_step": results["prompts"][prompts]}), flush=True)
    for length in (16, 64, 256):
        res = run_easyvlm(model_dir, args, length)
        results["response"][length] = round(timed_median(res["step_s"]), 3)
        print(json.dumps({"prompts": args.prompts, "max_response": length, "s_per_step": results["response"][length]}), flush=True)
    exponents = {axis: round(fit_exponent(list(map(float, v)), list(v.values())), 3) for axis, v in results.items()}
    print(json.dumps({"bench": "vs_trl_scaling", "model": args.scaling_model, "threads": args.threads,
                      "s_per_step": results, "exponents": exponents}))


def mode_overhead(args) -> None:
    """The demo config as it is (examples/config.yaml; no validation): the share of step time outside
    generation, log-prob and update compute, from the timing metrics and the worker-side execution
    times of every call (Ray's timeline), plus the weight sync measured alone."""
    out_dir = tempfile.mkdtemp(prefix="easyvlm-overhead-")
    overrides = [
        f"config={REPO / 'examples' / 'config.yaml'}", f"trainer.max_steps={args.steps}", "trainer.val_before_train=false",
        "trainer.val_freq=-1", "trainer.save_freq=-1", "trainer.find_last_checkpoint=false", "trainer.logger=[file]",
        f"trainer.save_checkpoint_path={out_dir}",
    ]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--easyvlm-driver", out_dir, "--", *overrides]
    _watch(cmd, args.threads, Path(out_dir) / "run.log", args.timeout)
    rows = [json.loads(line) for line in (Path(out_dir) / "experiment_log.jsonl").read_text().splitlines() if line.strip()]
    res = {"rows": rows, "worker_exec": json.loads((Path(out_dir) / "worker_exec.json").read_text())}
    # the demo: KL loss (reference log-probs); old log-probs when the update takes more than one
    # optimizer step (two PPO mini-batches since issue 35; the run logs timing_s/old then)
    old = ["compute_logprobs"] if "timing_s/old" in rows[-1] else []
    methods = ["generate", *old, "compute_ref_logprobs", "update_actor"]
    table = {**_timing_table(rows), **_exec_table(res, methods)}
    if "exec_unmatched_calls" in table:  # events lost: the per-call split would be wrong
        raise SystemExit(
            f"overhead: Ray's timeline holds {int(table['exec_unmatched_calls'])} worker calls for "
            f"{len(rows)} steps x {len(methods)}; it drops events of the last calls when the run ends. Rerun "
            "(fewer --steps lose fewer; the default is 3)."
        )
    sync = json.loads((Path(out_dir) / "sync.json").read_text())
    step = table["step"]
    compute = table.get("exec_generate", 0) - sync["median_s"] + table.get("exec_compute_logprobs", 0) \
        + table.get("exec_compute_ref_logprobs", 0) + table.get("exec_update_actor", 0)
    overhead = step - compute
    print(json.dumps({"bench": "vs_trl_overhead", "threads": args.threads, "timing_s": table, "weight_sync_s": sync,
                      "compute_s": round(compute, 3), "overhead_s": round(overhead, 3),
                      "overhead_share": round(overhead / step, 3)}))


def _exec_table(res: dict, methods: list[str]) -> dict[str, float]:
    """Median (over steps after the first) worker-side seconds per hybrid method; ``methods``: the
    hybrid calls of one step in the trainer's order (no validation or checkpoints in these runs)."""
    calls = res["worker_exec"]
    expected = len(res["rows"]) * len(methods)
    # the trainer kills its actors right after the last call, often before they report its events
    if len(calls) not in (expected, expected - 1):
        return {"exec_unmatched_calls": float(len(calls))}
    table = {}
    for i, method in enumerate(methods):
        timed = calls[i :: len(methods)][1:]  # steps after the warm-up
        if timed:
            table[f"exec_{method}"] = round(statistics.median(c["exec_s"] for c in timed), 3)
            table[f"transfer_{method}"] = round(statistics.median(c["call_s"] - c["exec_s"] for c in timed), 3)
    return table


# ------------------------------------------------------------------------------------------------ driver
def easyvlm_driver(out_dir: str, overrides: list[str]) -> None:
    """``easyvlm.trainer.main`` in this process, then: the worker-side execution time of every call
    of the hybrid workers (from Ray's task events, by method, in call order) and, for the overhead
    mode, the weight sync (actor gather + vLLM reload) timed alone in this process."""
    import ray

    from easyvlm.trainer.main import main

    main(overrides)
    time.sleep(3)  # workers flush their task events about once a second: wait for the last call's
    exec_times = _worker_exec_times(ray)
    Path(out_dir, "worker_exec.json").write_text(json.dumps(exec_times))
    ray.shutdown()
    if any(o.startswith("config=") for o in overrides) and not any("model_path" in o for o in overrides):
        Path(out_dir, "sync.json").write_text(json.dumps(_time_weight_sync(overrides)))


def _worker_exec_times(ray) -> list[dict[str, float]]:
    """Every ``_RankHost.call`` of the busiest actor (the hybrid worker of rank 0), in call order:
    seconds in the call, executing the method, and deserialising its arguments (Ray's timeline)."""
    events = ray.timeline()
    calls = [e for e in events if e.get("cat") == "task::_RankHost.call"]
    if not calls:
        return []
    tid = max({e.get("tid") for e in calls}, key=lambda t: sum(1 for e in calls if e.get("tid") == t))
    calls = sorted((e for e in calls if e.get("tid") == tid), key=lambda e: e["ts"])
    inner = [e for e in events if e.get("tid") == tid and e.get("cat") in ("task:execute", "task:deserialize_arguments")]
    out = []
    for call in calls:
        parts = {e["cat"]: e["dur"] / 1e6 for e in inner if call["ts"] <= e["ts"] <= call["ts"] + call["dur"]}
        out.append({"call_s": call["dur"] / 1e6, "exec_s": parts.get("task:execute", 0.0),
                    "deserialize_s": parts.get("task:deserialize_arguments", 0.0)})
    return out


def _time_weight_sync(overrides: list[str], repeats: int = 5) -> dict:
    """The hybrid worker of the run's plan, in this process: ``repeats`` syncs after one warm-up."""
    from easyvlm.workers.hybrid import HybridWorker

    plan = bench_plan(overrides, total_steps=10)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    worker = HybridWorker(plan.actor, plan.ref, plan.rollout)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        worker.rollout.update_weights(worker.actor.state_dict_for_sync().items())
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times[1:]), "runs_s": times[1:]}


def _free_port() -> int:
    from easyvlm.workers.dist import find_free_port

    return find_free_port()


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--easyvlm-driver":
        easyvlm_driver(argv[1], argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["compare", "breakdown", "scaling", "overhead"], default="compare")
    parser.add_argument("--models", default="tiny,bench", help="compare: which of tiny, bench")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every run and of the matmul peak")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=128, help="bench model")
    parser.add_argument("--tiny-response", type=int, default=8, help="tiny model (the demo's)")
    parser.add_argument("--micro", type=int, default=16, help="sequences per forward/backward, both frameworks")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--scaling-model", default=TINY)
    parser.add_argument("--scaling-response", type=int, default=8, help="scaling over prompts: response length")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per training run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="compare: runs of each framework per model, alternated; figures are the median run's, "
                             "with every run's s/step and the spread (slowest / fastest)")
    parser.add_argument("--pss", action="store_true",
                        help="also sample each process's PSS (smaps_rollup): the page-table walks took 8-27%% of a "
                             "core and made the bench run's step ~10%% slower on 2 cores, so timing runs leave it off; "
                             "bench/process_tree_memory.py measures PSS")
    args = parser.parse_args(argv)
    {"compare": mode_compare, "breakdown": mode_breakdown, "scaling": mode_scaling, "overhead": mode_overhead}[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
