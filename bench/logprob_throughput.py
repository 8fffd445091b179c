"""Log-prob throughput of ActorWorker.compute_logprobs: padded vs padding-free (packed) forward.

    PYTHONPATH=. python bench/logprob_throughput.py [--model builtin:tiny-qwen2.5-vl] [--batch 64]
        [--max-response 256] [--micro 16] [--threads 2] [--repeats 3]

A single-process gloo group (rank 0 of 1) on the CPU, or the current CUDA device. The batch mixes
what RL batches look like: 2/3 of the prompts carry an image (two sizes), 1/3 are text-only, prompt
lengths vary, and response lengths are long-tailed (log-normal, clipped to --max-response), so the
padded layout wastes most of its positions on padding. Reported: attended tokens (prompt +
response) per second, the median of --repeats timed runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from easyvlm.config.schema import ActorConfig, ModelConfig
from easyvlm.data.batch import Batch
from easyvlm.data.collate import left_pad
from easyvlm.models.builtin import resolve_model_path
from easyvlm.models.position_ids import extend_position_ids, get_position_ids
from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.dist import init_distributed

QUESTIONS = [
    "What colour is the shape?",
    "How many dots are there in the picture? Answer with a number.",
    "Is the square to the left of the circle?",
    "Describe the image in one short sentence, then give the count of red objects.",
    "hi",
]


def make_batch(model_dir: str, batch_size: int, max_response: int, seed: int = 0) -> Batch:
    """A realistic RL batch (layout as the trainer builds it) with random response tokens."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
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
    model_dir = resolve_model_path(args.model)
    batch = make_batch(model_dir, args.batch, args.max_response)
    attended = int(batch["attention_mask"].sum())
    print(f"model {args.model}; batch {args.batch} x {batch['input_ids'].shape[1]} positions, "
          f"{attended} attended tokens ({attended / batch['attention_mask'].numel():.0%}); "
          f"torch threads {torch.get_num_threads()}; device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    variants = {
        "padded": dict(padding_free=False, dynamic_batching=False),
        "padding-free": dict(padding_free=True, dynamic_batching=False),
        "padding-free + dynamic batching": dict(padding_free=True, dynamic_batching=True),
    }
    print(f"| layout | median s | tokens/s | speed-up |\n|---|---|---|---|")
    base = None
    for name, flags in variants.items():
        cfg = ActorConfig(
            model=ModelConfig(model_path=model_dir, enable_gradient_checkpointing=False),
            micro_batch_size_per_device_for_experience=args.micro,
            **flags,
        )
        worker = ActorWorker(cfg, rank=0, world_size=1, total_steps=1)
        median = statistics.median(time_logprobs(worker, batch, args.repeats))
        base = base or median
        print(f"| {name} | {median:.3f} | {attended / median:,.0f} | {base / median:.2f}x |", flush=True)
        del worker


if __name__ == "__main__":
    main(sys.argv[1:])
