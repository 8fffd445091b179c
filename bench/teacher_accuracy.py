"""Greedy and sampled accuracy of a builtin model on the synthetic task's validation split.

    PYTHONPATH=. python bench/teacher_accuracy.py --model builtin:tiny-qwen2.5-vl-teacher
    PYTHONPATH=. python bench/teacher_accuracy.py --model builtin:tiny-qwen2.5-vl-synthetic   # the demo's student

What it measures: how often the model's answer is right, on every prompt of ``--data`` (default
the demo's ``data.val_files``), answered once greedily and ``--samples`` times at temperature 1
(what the demo's rollout samples at; seeded by ``--seed``). A teacher for on-policy distillation
should be right at both: its log-probs on the student's samples are the training signal.

How: the prompts are the RL pipeline's own (``RLDataset`` with the demo's data settings and
format prompt, batched by ``collate_prompts``), so tokens, images and mRoPE positions are the ones
the rollout and the teacher's forward see. Generation is a plain loop over the transformers model's
forward (KV cache, left-padded batch, the pipeline's positions extended by one per new token) for
at most ``--max-tokens`` tokens (the demo's max_response_length); its greedy answers equal
``model.generate``'s (which computes the mRoPE positions itself) on padded mixed-length batches.
Each response, decoded without special tokens, is scored by reward_functions/synthetic.py's
``compute_score`` (its ``accuracy``). Prints the accuracies (overall and per task) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_reward(path: Path):
    spec = importlib.util.spec_from_file_location("synthetic_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def load_prompts(model_dir: Path, data: str):
    """(the processor, the model config, the RLDataset of ``data``), as the demo run builds them."""
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.builtin.synthetic import resolve_builtin_dataset
    from easyvlm.data.dataset import RLDataset
    from easyvlm.data.settings import DataConfig

    processor = AutoProcessor.from_pretrained(model_dir)
    model_config = AutoConfig.from_pretrained(model_dir)
    # examples/config.yaml's data section (the keys that change a prompt)
    cfg = DataConfig(
        prompt_key="problem", answer_key="answer", image_key="images", max_prompt_length=256,
        format_prompt=str(REPO / "format_prompts" / "synthetic.jinja"), min_pixels=3136, max_pixels=50176,
    )
    path = resolve_builtin_dataset(data) if data.startswith("builtin:") else data
    dataset = RLDataset(str(path), cfg, processor.tokenizer, processor, model_config, key="data.val_files", name="val")
    return processor, model_config, dataset


@torch.no_grad()
def generate(model, batch, eos_ids: list[int], pad: int, max_tokens: int, generator: torch.Generator | None):
    """Response token lists of a left-padded prompt batch: greedy if ``generator`` is None, else
    sampled at temperature 1. Each list ends at (and holds) its first EOS."""
    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.models.position_ids import extend_position_ids, to_model_layout

    mask = batch["attention_mask"].long()
    positions = batch["position_ids"]
    out = model(
        input_ids=batch["input_ids"], attention_mask=mask, position_ids=to_model_layout(positions), use_cache=True,
        **concat_multi_modal_inputs(batch["multi_modal_inputs"]),
    )
    eos = torch.tensor(eos_ids)
    done = torch.zeros(len(mask), dtype=torch.bool)
    tokens = []
    for _ in range(max_tokens):
        logits = out.logits[:, -1].float()
        if generator is None:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        token = token.masked_fill(done, pad)
        tokens.append(token)
        done |= torch.isin(token, eos)
        if done.all():
            break
        # the next token's position: one past the last (a left-padded prompt's last column is real)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = extend_position_ids(positions, 1)
        out = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=to_model_layout(positions[..., -1:]),
            past_key_values=out.past_key_values, use_cache=True,
        )
    responses = []
    for row in torch.stack(tokens, dim=1).tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        responses.append(row[: ends[0] + 1] if ends else row)
    return responses


def accuracy(scores: list[dict], tasks: list[str]) -> dict[str, float]:
    """Mean accuracy overall and per task."""
    out = {"all": sum(s["accuracy"] for s in scores) / len(scores)}
    for task in sorted(set(tasks)):
        picked = [s["accuracy"] for s, t in zip(scores, tasks) if t == task]
        out[task] = sum(picked) / len(picked)
    return out


def main(argv: list[str] | None = None) -> dict:
    import transformers
    from transformers import AutoModelForImageTextToText

    import easyvlm.builtin
    from easyvlm.data.collate import collate_prompts
    from easyvlm.models.paths import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-qwen2.5-vl-teacher", help="builtin:NAME or a model directory")
    parser.add_argument("--data", default="builtin:synthetic-colour@val", help="the demo's data.val_files")
    parser.add_argument("--samples", type=int, default=4, help="sampled answers per prompt (temperature 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")
    parser.add_argument("--max-tokens", type=int, default=8, help="longest response (the demo's max_response_length)")
    parser.add_argument("--batch-size", type=int, default=256, help="prompts per forward")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    easyvlm.builtin.register()
    model_dir = Path(resolve_model_path(args.model))  # builds a builtin model on first use
    processor, model_config, dataset = load_prompts(model_dir, args.data)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = processor.tokenizer
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]  # generation_config's
    compute_score = load_reward(REPO / "reward_functions" / "synthetic.py")

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    results, example = {}, {}
    for mode, n in (("greedy", 1), ("sampled", args.samples)):
        scores, tasks = [], []
        for first in range(0, len(dataset), args.batch_size):
            samples = [dataset[i] for i in range(first, min(first + args.batch_size, len(dataset)))]
            batch = collate_prompts(samples, dataset.pad_token_id).repeat(n, interleave=True)
            responses = generate(model, batch, eos_ids, dataset.pad_token_id, args.max_tokens,
                                 None if mode == "greedy" else generator)
            texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            truths = batch["ground_truth"]
            scores += compute_score([{"response": t, "ground_truth": g} for t, g in zip(texts, truths)])
            tasks += [extra.get("task", "all") for extra in batch["extra"]]
            example.setdefault(mode, list(zip(texts, truths))[:4])
        results[mode] = accuracy(scores, tasks)
        per_task = ", ".join(f"{t} {a:.3f}" for t, a in results[mode].items() if t != "all")
        print(f"{mode:>7}: accuracy {results[mode]['all']:.3f} over {len(scores)} answers ({per_task}); "
              f"e.g. {example[mode]}")
    summary = {
        "model": args.model, "data": args.data, "prompts": len(dataset), "samples": args.samples, "seed": args.seed,
        "greedy_accuracy": round(results["greedy"]["all"], 4), "sampled_accuracy": round(results["sampled"]["all"], 4),
        "per_task": results, "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
