"""Where one hybrid worker's memory goes, phase by phase (in this process, no Ray).

    PYTHONPATH=. python bench/worker_memory.py [--model bench|tiny] [--steps 2] [--profile] [overrides ...]

Builds the trainer's hybrid worker (FSDP actor, reference model when the KL is on, vLLM engine)
from the run plan of the bench (``bench/vs_trl.py``'s settings for ``--model bench``: EOS-free bench
model, 16 prompts x 8 samples x 128 tokens) or the demo (``--model tiny``: examples/config.yaml),
then runs ``--steps`` steps of generate -> (reference log-probs) -> update on the real prompts
(random advantages: the memory does not depend on their values). After each phase it prints the
process's resident memory now (after glibc's ``malloc_trim``: what the process still holds) and
its peak so far (``ru_maxrss``: start it from a shell, not from a large process, whose size Linux
would carry over), so the rise of the peak in a phase is what that phase needed on top of what was
held before; and, per update micro-batch, the activations autograd saved for backward. The process
also holds what a Ray worker would not: the driver's data (~0.27 GiB). It runs on the easyvlm of
PYTHONPATH (e.g. an unpacked ``git archive`` of another commit, to compare). ``--profile``: one more
update of the last step's batch under torch's profiler, its operators by CPU time (where an update's
time goes: docs/benchmarks.md, "The update's matrix products").
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


rows: list[tuple[str, float, float, float]] = []
_last = [time.perf_counter()]


def trim() -> None:
    """glibc's malloc_trim(0): freed memory the heap still holds goes back, so RSS shows what is held."""
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)


def mark(phase: str) -> None:
    trim()
    now = time.perf_counter()
    rows.append((phase, rss_now() / MiB, peak() / MiB, now - _last[0]))
    _last[0] = now
    print(f"{phase:<44} RSS {rows[-1][1]:8.0f} MiB   peak {rows[-1][2]:8.0f} MiB   ({rows[-1][3]:.1f} s)", flush=True)


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward during each forward of ``model``
    (one forward per micro-batch of the update): the activations a micro-batch holds at its peak."""

    def __init__(self, model):
        self.model, self.per_forward, self._seen = model, [], {}

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        self._seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    def _start(self, *_):
        self._seen = {}

    def _end(self, *_):
        self.per_forward.append(sum(self._seen.values()))

    def __enter__(self) -> "SavedActivations":
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._handles = [self.model.register_forward_pre_hook(self._start), self.model.register_forward_hook(self._end)]
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="profile one more update (operators by CPU time)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mark("start")
    import torch

    mark("import torch")
    from bench_support import bench_plan, eos_free_model, example_args

    from easyvlm.data.batch import UPDATE_INPUT_KEYS
    from easyvlm.plan.dataloaders import plan_dataloaders
    from easyvlm.workers.dist import find_free_port

    mark("import easyvlm (driver side)")
    import easyvlm

    # the examples/config.yaml of the easyvlm being measured (PYTHONPATH), not necessarily this checkout's
    plan_config = f"config={Path(easyvlm.__file__).resolve().parents[1] / 'examples' / 'config.yaml'}"

    def own_config(args: list[str]) -> list[str]:
        return [plan_config if a.startswith("config=") else a for a in args]

    if args.model == "bench":
        from vs_trl import BENCH, easyvlm_overrides

        overrides = easyvlm_overrides(eos_free_model(BENCH), 16, 8, 128, args.steps, 1e-5, 16, "/tmp/worker-memory-bench")
        overrides = [o for o in overrides if not o.startswith("config=")]
        plan = bench_plan(own_config(example_args(*overrides, *args.overrides)), total_steps=args.steps)
    else:
        plan = bench_plan(own_config(example_args("trainer.save_checkpoint_path=/tmp/worker-memory-demo", *args.overrides)),
                          total_steps=args.steps)
    train_loader, _ = plan_dataloaders(plan)
    print(f"easyvlm from {Path(easyvlm.__file__).parent}; {plan_config}", flush=True)
    mark("plan + data")
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    import easyvlm.workers.hybrid as hybrid
    from easyvlm.rollout import vllm as _  # noqa: F401 (vllm's import, counted apart)

    mark("import the worker (vllm)")
    build_rollout = hybrid.build_rollout

    def build_traced(spec):
        mark("build: actor (+ reference model)")
        return build_rollout(spec)

    hybrid.build_rollout = build_traced
    worker = hybrid.HybridWorker(plan.actor, plan.ref, plan.rollout)
    mark("build: vLLM engine (weights + KV cache)")
    batches = iter(train_loader)
    for step in range(1, args.steps + 1):
        prompts = next(batches)
        batch = worker.generate(prompts)
        mark(f"step {step}: generate ({len(batch)} sequences)")
        if plan.ref is not None:
            batch = batch.union(worker.compute_ref_logprobs(batch.select(*[k for k in UPDATE_INPUT_KEYS if k in batch], meta=False)))
            mark(f"step {step}: reference log-probs")
        mask = batch["response_mask"].float()
        batch["advantages"] = torch.randn(mask.shape) * mask
        batch["returns"] = batch["advantages"]
        update = batch.select(*[k for k in UPDATE_INPUT_KEYS if k in batch], meta=False)
        with SavedActivations(worker.actor.model) as saved:
            worker.update_actor(update)
        mark(f"step {step}: update")
        print(f"  activations autograd saved per micro-batch forward (MiB): {[round(b / MiB) for b in saved.per_forward]}",
              flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            worker.update_actor(update)
        print(f"\nprofiled update: {time.perf_counter() - start:.2f} s (profiler included)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print("\n| phase | RSS after (MiB) | peak so far (MiB) | s |\n|---|---|---|---|")
    for phase, now, top, secs in rows:
        print(f"| {phase} | {now:.0f} | {top:.0f} | {secs:.1f} |")


if __name__ == "__main__":
    main()
