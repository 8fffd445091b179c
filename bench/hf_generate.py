"""The transformers rollout engine against a bare ``model.generate`` on the same model, batch and lengths.

    PYTHONPATH=. python bench/hf_generate.py [--shape qwen2.5-vl-3b] [--prompts 16] [--n 8]
        [--response-length 256] [--image-size 448] [--repeats 3]
    PYTHONPATH=. python bench/hf_generate.py --tiny     # the builtin tiny model's shapes, CPU, fp32

The model and prompts are bench/gpu_step.py's (random weights of a real model's shapes, EOS-free:
every response runs to ``--response-length``); the engine is the one the trainer builds
(``worker.rollout.name=hf``, the GPU recipes' plan). Both sides generate from the one model object
the engine loaded:

- *engine*: ``HFRolloutEngine.generate(batch)``, as the trainer calls it (n samples per prompt,
  seeded per request, the batch's mRoPE positions, blocked tokens suppressed, the sampled
  distribution's log-probs and the output Batch built);
- *bare*: ``model.generate(**processor outputs)`` of the same rows repeated n times, sampling at the
  same temperature, ``max_new_tokens`` the response length: what a user would write.

Each side runs ``--repeats`` times, alternating, after one warm-up each; the medians and the ratio
(bare seconds / engine seconds: the engine's speed as a fraction of bare generate's) are printed,
and the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    import gpu_step

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu_step.add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up each")
    parser.add_argument("--model-dir", default=None, help="a model bench/gpu_step.py --work-dir W wrote (W/model) "
                        "for this --shape: used instead of writing one")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run's config")
    return gpu_step.with_workload_defaults(parser.parse_args(argv))


def bare_inputs(batch, n: int, device: str) -> dict:
    """The processor's outputs of ``batch``'s prompts, each row repeated ``n`` times (the engine's order)."""
    import torch

    from easyvlm.data.collate import concat_multi_modal_inputs

    rows = batch.repeat(n, interleave=True)
    inputs = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"].long()}
    inputs.update(concat_multi_modal_inputs(rows.get("multi_modal_inputs") or []))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import os

    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from transformers import GenerationConfig

    import gpu_step
    from bench_support import bench_plan, cpu_description

    from easyvlm.plan.dataloaders import plan_dataloaders
    from easyvlm.rollout.factory import build_rollout

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --tiny for the CPU")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    work_dir = Path(tempfile.mkdtemp(prefix="easyvlm-hf-generate-"))
    try:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            (work_dir / "model").mkdir()
            model_dir = gpu_step.write_random_model(gpu_step.shapes()[args.shape].spec, work_dir / "model", device, dtype)
        prompts = gpu_step.write_prompts(work_dir, args.prompts, args.image_size, args.question_tokens)
        plan = bench_plan(gpu_step.plan_args(args, model_dir, prompts, work_dir, "hf"))
        batch = next(iter(plan_dataloaders(plan)[0]))
        engine = build_rollout(plan.rollout)
        sampling = engine.sampling
        inputs = bare_inputs(batch, sampling.n, device)
        config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                  max_new_tokens=sampling.max_tokens, pad_token_id=engine.pad_token_id)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def engine_call():
            out = engine.generate(batch)
            return int(out["response_mask"].sum())

        def bare_call():
            with torch.no_grad():
                out = engine.model.generate(**inputs, generation_config=config)
            return out[:, inputs["input_ids"].shape[1]:].numel()  # every row runs to the length (EOS-free)

        seconds: dict[str, list[float]] = {"engine": [], "bare": []}
        tokens: dict[str, int] = {}
        for repeat in range(args.repeats + 1):
            for name, call in (("engine", engine_call), ("bare", bare_call)):
                sync()
                start = time.perf_counter()
                tokens[name] = call()
                sync()
                elapsed = time.perf_counter() - start
                print(f"{'warm-up' if repeat == 0 else f'repeat {repeat}'}: {name} {elapsed:.2f} s, "
                      f"{tokens[name]} tokens", flush=True)
                if repeat:
                    seconds[name].append(elapsed)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    summary = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if cuda else cpu_description(),
        "rows": len(batch) * sampling.n, "response_length": sampling.max_tokens,
        "engine_s": median["engine"], "bare_s": median["bare"], "engine_tokens": tokens["engine"],
        "bare_tokens": tokens["bare"], "engine_tokens_per_s": tokens["engine"] / median["engine"],
        "bare_tokens_per_s": tokens["bare"] / median["bare"], "engine_vs_bare": median["bare"] / median["engine"],
        "seconds": seconds,
    }
    print(f"engine {median['engine']:.2f} s, bare generate {median['bare']:.2f} s (medians of {args.repeats}): "
          f"the engine at {summary['engine_vs_bare']:.2f}x bare generate's speed", flush=True)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
