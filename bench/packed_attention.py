"""Packed (padding-free) attention: SDPA once per sequence against the batched flex_attention kernel.

    PYTHONPATH=. python bench/packed_attention.py [--device cpu|cuda] [--threads 1] [--repeats 5]
                                                  [--no-compiled] [--json out.json]

One attention call on one packed row (1, H, N, D), as a decoder layer of the padding-free forward
makes it (easyvlm.models.padding_free._packed_attention), for a few packed micro-batches:

- ``tiny demo``: the demo model's attention (4 heads, 2 key/value heads, head dim 32), 4 prompts x
  4 samples, shared prompts (the default).
- ``3B plain`` / ``3B shared``: Qwen2.5-VL-3B's text attention (16 heads, 2 key/value heads, head
  dim 128), 8 samples of a 300-token prompt (a 448x448 image is 256 of them) and responses of up to
  256 tokens: every sample packed whole, and 2 prompts x 4 samples with shared prompts.

Rows (the median of --repeats timed calls after one warm-up call; forward, then forward + backward
with a random output gradient):

- ``sdpa``: SDPA per sequence (per trunk and per run of equal branches with shared prompts): the CPU
  default.
- ``flex``: the batched kernel as easyvlm runs it on this device: eager flex_attention on the CPU
  (torch's dense reference; its backward exists but torch refuses it on the CPU, so here that one
  check is lifted, as in tests/models/test_packed_attention.py), ``torch.compile(flex_attention)``
  on CUDA. The BlockMask is built once per row (a forward reuses it in every layer); its build time
  is printed apart.
- ``flex compiled`` (CPU only, forward only, unless --no-compiled): inductor's CPU kernel at this one
  shape (``dynamic=False``; compile time excluded), to show what compilation buys on the CPU.

float32 on the CPU, bfloat16 on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from easyvlm.models.flex_packed import segment_block_mask
from easyvlm.models.padding_free import _packed_attention
from easyvlm.models.segments import packed_segments


def _row(prompts: int, samples: int, prompt_len: int, max_response: int, shared: bool, seed: int) -> list[int]:
    """Text positions of a packed row: per prompt, ``samples`` responses of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    positions: list[int] = []
    for _ in range(prompts):
        lengths = torch.randint(max_response // 8, max_response + 1, (samples,), generator=gen).tolist()
        for j, n in enumerate(lengths):
            start = prompt_len if shared and j > 0 else 0
            positions += list(range(start, prompt_len + n))
    return positions


SHAPES = {  # label: (query heads, key/value heads, head dim, text positions of the row)
    "tiny demo, 4 prompts x 4 samples, shared prompts": (4, 2, 32, _row(4, 4, 90, 64, True, 0)),
    "3B plain, 8 samples x (300 + <=256)": (16, 2, 128, _row(8, 1, 300, 256, False, 1)),
    "3B shared, 2 prompts x 4 samples x (300 + <=256)": (16, 2, 128, _row(2, 4, 300, 256, True, 1)),
}


def _median_ms(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled CPU forward")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    if device.type == "cpu":  # lift flex_attention's refusal of a CPU backward (see the docstring)
        import torch.nn.attention.flex_attention as fa

        original = fa._validate_device
        fa._validate_device = lambda q, k, v: original(q.detach(), k.detach(), v.detach())
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"{args.threads} thread(s), torch {torch.__version__}, {dtype}")
    results = []
    for label, (H, Hkv, D, positions) in SHAPES.items():
        segments, N = packed_segments(positions), len(positions)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, N, D, generator=gen).to(device, dtype).requires_grad_()
        k, v = (torch.randn(1, Hkv, N, D, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
        grad = torch.randn(1, N, H, D, generator=gen).to(device, dtype)
        mask_ms = _median_ms(lambda: segment_block_mask(segments, N, device), args.repeats, sync)
        row = dict(shape=label, tokens=N, sequences=len(segments), heads=(H, Hkv, D), block_mask_ms=mask_ms)
        for kernel in ("sdpa", "flex"):
            def forward():
                with torch.no_grad():
                    _packed_attention(q, k, v, segments, 0.0, None, kernel)

            def forward_backward():
                out = _packed_attention(q, k, v, segments, 0.0, None, kernel)
                torch.autograd.grad(out, (q, k, v), grad)

            row[f"{kernel}_forward_ms"] = _median_ms(forward, args.repeats, sync)
            row[f"{kernel}_forward_backward_ms"] = _median_ms(forward_backward, args.repeats, sync)
        if device.type == "cpu" and not args.no_compiled:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=False)
            block_mask = segment_block_mask(segments, N, device)
            qd, kd, vd = (t.detach() for t in (q, k, v))
            row["flex_compiled_forward_ms"] = _median_ms(
                lambda: compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=H != Hkv), args.repeats, sync
            )
        results.append(row)
        print(f"\n{label}: N = {N} tokens, {len(segments)} segments, heads {H}/{Hkv} x {D}; "
              f"BlockMask {mask_ms:.2f} ms")
        print(f"  {'kernel':<16}{'forward ms':>12}{'fwd+bwd ms':>12}")
        for kernel in ("sdpa", "flex"):
            print(f"  {kernel:<16}{row[f'{kernel}_forward_ms']:>12.2f}{row[f'{kernel}_forward_backward_ms']:>12.2f}")
        if "flex_compiled_forward_ms" in row:
            print(f"  {'flex compiled':<16}{row['flex_compiled_forward_ms']:>12.2f}{'-':>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
