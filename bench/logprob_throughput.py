"""Log-prob throughput of ActorWorker.compute_logprobs: padded vs padding-free (packed) forward.

    PYTHONPATH=. python bench/logprob_throughput.py [--model builtin:tiny-qwen2.5-vl] [--batch 64]
        [--max-response 256] [--micro 16] [--threads 2] [--repeats 3]

A single-process gloo group (rank 0 of 1) on the CPU, or the current CUDA device. The batch mixes
what RL batches look like: 2/3 of the prompts carry an image (two sizes), 1/3 are text-only, prompt
lengths vary, and response lengths are long-tailed (log-normal, clipped to --max-response), so the
padded layout wastes most of its positions on padding. Reported: attended tokens (prompt +
response) per second, the median of --repeats timed runs after one warm-up run. Each worker is
built from the run plan of the demo config with the layout's settings (``bench_support.bench_plan``);
everything else a log-prob pass reads (shared prompts, no token budget, torch.compile on, the
rollout temperature 1) is the config schema's default, as in earlier runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_support import bench_plan, example_args  # noqa: E402

from easyvlm.data.batch import Batch  # noqa: E402
from easyvlm.data.collate import left_pad  # noqa: E402
from easyvlm.models.position_ids import extend_position_ids, get_position_ids  # noqa: E402
from easyvlm.workers.actor import ActorWorker  # noqa: E402
from easyvlm.workers.dist import init_distributed  # noqa: E402

QUESTIONS = [
    "What colour is the shape?",
    "How many dots are there in the picture? Answer with a number.",
    "Is the square to the left of the circle?",
    "Describe the image in one short sentence, then give the count of red objects.",
    "hi",
]


def actor_spec(model: str, micro: int, padding_free: bool, dynamic_batching: bool):
    """The actor's slice of the demo config's plan with one layout, ``micro`` samples per pass."""
    return bench_plan(example_args(
        f"worker.actor.model.model_path={model}",
        f"worker.actor.micro_batch_size_per_device_for_experience={micro}",
        f"worker.actor.padding_free={str(padding_free).lower()}",
        f"worker.actor.dynamic_batching={str(dynamic_batching).lower()}",
        "worker.actor.model.enable_gradient_checkpointing=false",
        "worker.actor.use_torch_compile=true",  # the schema's default (the demo config turns it off)
    )).actor


def make_batch(spec, batch_size: int, max_response: int, seed: int = 0) -> Batch:
    """A realistic RL batch (layout as the trainer builds it) with random response tokens, from the
    plan's processor and model config (``spec``: an `ActorSpec`)."""
    from PIL import Image

    processor, hf_config = spec.files.processor, spec.model.hf_config
    tokenizer = processor.tokenizer
    rng = np.random.default_rng(seed)
    ids, positions, mm_inputs = [], [], []
    for i in range(batch_size):
        size = [(56, 56), (84, 84), None][i % 3]
        question = QUESTIONS[rng.integers(len(QUESTIONS))] * int(rng.integers(1, 4))
        content = ([{"type": "image"}] if size else []) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))] if size else None
        enc = processor(text=[text], images=images, return_tensors="pt")
        grid = enc.get("image_grid_thw")
        ids.append(enc["input_ids"][0])
        positions.append(get_position_ids(enc["input_ids"], enc["attention_mask"], grid, model_config=hf_config)[0])
        mm_inputs.append({"pixel_values": enc["pixel_values"], "image_grid_thw": grid} if size else {})
    prompt_ids = left_pad(ids, tokenizer.pad_token_id)
    P = prompt_ids.shape[1]
    prompt_mask = torch.arange(P)[None, :] >= torch.tensor([P - len(x) for x in ids])[:, None]
    # long-tailed response lengths: median ~ max/6, some hit the cap
    lengths = np.clip(rng.lognormal(np.log(max_response / 6), 0.9, batch_size).astype(int), 1, max_response)
    lengths[0] = max_response  # the padded width is set by the longest response, as in practice
    response_mask = torch.arange(max_response)[None, :] < torch.tensor(lengths)[:, None]
    responses = torch.randint(0, 256, (batch_size, max_response), generator=torch.Generator().manual_seed(seed))
    responses = responses.masked_fill(~response_mask, tokenizer.pad_token_id)
    return Batch(
        {
            "input_ids": torch.cat([prompt_ids, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "position_ids": extend_position_ids(left_pad(positions, 0), max_response),
            "responses": responses,
            "response_mask": response_mask,
        },
        {"multi_modal_inputs": mm_inputs},
    )


def time_logprobs(worker: ActorWorker, batch: Batch, repeats: int) -> list[float]:
    worker.compute_logprobs(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        worker.compute_logprobs(batch)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-qwen2.5-vl")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=16, help="micro_batch_size_per_device_for_experience")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    init_distributed()
    variants = {
        "padded": dict(padding_free=False, dynamic_batching=False),
        "padding-free": dict(padding_free=True, dynamic_batching=False),
        "padding-free + dynamic batching": dict(padding_free=True, dynamic_batching=True),
    }
    specs = {name: actor_spec(args.model, args.micro, **flags) for name, flags in variants.items()}
    batch = make_batch(specs["padded"], args.batch, args.max_response)
    attended = int(batch["attention_mask"].sum())
    print(f"model {args.model}; batch {args.batch} x {batch['input_ids'].shape[1]} positions, "
          f"{attended} attended tokens ({attended / batch['attention_mask'].numel():.0%}); "
          f"torch threads {torch.get_num_threads()}; device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print("| layout | median s | tokens/s | speed-up |\n|---|---|---|---|")
    base = None
    for name, spec in specs.items():
        worker = ActorWorker(spec, rank=0, world_size=1)
        median = statistics.median(time_logprobs(worker, batch, args.repeats))
        base = base or median
        print(f"| {name} | {median:.3f} | {attended / median:,.0f} | {base / median:.2f}x |", flush=True)
        del worker


if __name__ == "__main__":
    main(sys.argv[1:])
