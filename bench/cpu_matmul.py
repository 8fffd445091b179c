"""float32 linear layers on this CPU: torch's ``F.linear`` (MKL) against oneDNN (easyvlm.models.cpu_linear).

    PYTHONPATH=. python bench/cpu_matmul.py [--threads 2] [--repeats 15] [--rounds 3] [--json out.json]

For each shape (rows M x in_features K x out_features N): the bench model's linears over one
update micro-batch (16 sequences with shared prompts: ~2,200 tokens; bench/vs_trl.py), a decode
step's 128 rows, the demo model's, and a square 2048 product: the time of a forward and backward
(y = x W^T, then dL/dx and dL/dW: 6 M K N FLOPs) through each path, median over ``--repeats`` calls,
the two paths alternated over ``--rounds`` rounds (the median of the rounds' medians is reported).
oneDNN is forced for every shape here (easyvlm itself keeps calls below ``MIN_ONEDNN_MACS`` on
``F.linear`` and above it takes the faster kernel as timed on the machine: easyvlm.models.kernel_choice).
Also prints the CPU's vector extensions and torch's BLAS: MKL runs its AVX2 kernels on
CPUs that are not Intel's, whatever they support.
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
import torch.nn.functional as F

import easyvlm.models.cpu_linear as cpu_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import cpu_description  # noqa: E402

# (label, M, K, N)
SHAPES = [
    ("bench q/o_proj (2188 tokens)", 2188, 512, 512),
    ("bench k/v_proj", 2188, 512, 256),
    ("bench gate/up_proj", 2188, 512, 2048),
    ("bench down_proj", 2188, 2048, 512),
    ("bench lm_head (264 tokens vocab)", 2188, 512, 264),
    ("bench gate/up_proj, 128 rows (a decode step)", 128, 512, 2048),
    ("demo gate/up_proj (hidden 64, 2048 tokens)", 2048, 64, 128),
    ("demo q_proj, 256 rows", 256, 64, 64),
    ("square 2048", 2048, 2048, 2048),
]


def time_fwd_bwd(linear, x: torch.Tensor, weight: torch.Tensor, repeats: int) -> float:
    grad = torch.ones(x.shape[0], weight.shape[0])

    def once() -> None:
        xx, ww = x.detach().requires_grad_(), weight.detach().requires_grad_()
        linear(xx, ww).backward(grad)

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_linear.MIN_ONEDNN_MACS = 1  # every shape through oneDNN, to compare:
    os.environ[cpu_linear.ENV_SWITCH] = "onednn"  # not easyvlm's measured choice (which may be F.linear)
    blas = next((line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel Library" in line), "BLAS: see torch.__config__.show()")
    print(f"CPU: {cpu_description()}\ntorch {torch.__version__}, {args.threads} threads; {blas}\n")
    print(f"{'shape':<46} {'M x K x N':>18} {'F.linear GFLOP/s':>17} {'oneDNN GFLOP/s':>15} {'speed-up':>9}")
    rows = []
    for label, m, k, n in SHAPES:
        gen = torch.Generator().manual_seed(0)
        x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        rounds = {"aten": [], "onednn": []}
        for _ in range(args.rounds):
            rounds["aten"].append(time_fwd_bwd(F.linear, x, weight, args.repeats))
            rounds["onednn"].append(time_fwd_bwd(cpu_linear.onednn_linear, x, weight, args.repeats))
        aten, onednn = (statistics.median(rounds[key]) for key in ("aten", "onednn"))
        flop = 6 * m * k * n
        row = {"shape": label, "m": m, "k": k, "n": n, "aten_s": aten, "onednn_s": onednn,
               "aten_gflops": flop / aten / 1e9, "onednn_gflops": flop / onednn / 1e9, "speedup": aten / onednn}
        rows.append(row)
        print(f"{label:<46} {f'{m} x {k} x {n}':>18} {row['aten_gflops']:17.0f} {row['onednn_gflops']:15.0f} {row['speedup']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
