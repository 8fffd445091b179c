"""``python -m easyvlm.eval config=... worker.actor.model.model_path=<model> data.val_files=...``

Samples k = ``worker.rollout.val_override_config.n`` answers per prompt of ``data.val_files`` with
the configured rollout engine, scores them with the configured reward function(s) and reports
mean@k, pass@k and the mean of every reward key (named as the trainer's validation names them).
The model is a checkpoint (``global_step_<N>``, or a run directory: its latest), an exported
Hugging Face directory, a ``builtin:`` model or a hub id.

The config is the trainer's, checked by the same code (errors exit 2 before any model loads), with
``trainer.val_only=true`` implied: ``data.train_files`` may be empty. Validation batches and seeds
are the trainer's (``data.val_batch_size``; with ``worker.rollout.per_request_seed`` the prompts are
seeded from the checkpoint's step as the trainer's validation at that step), so a checkpoint's eval
reproduces the trainer's last validation at that step.

Writes ``<checkpoint>/eval/`` (else ``<trainer.save_checkpoint_path>/eval/``): ``summary.json`` and
the rollout viewer's pages (``rollouts/index.html``); the summary is also the last stdout line.
No Ray: the engine and the reward functions run in this process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.config.cli import exit_with_problems, parse_and_validate
from easyvlm.config.errors import Problem

EVAL_DIR = "eval"


def checkpoint_model(model_path: str) -> tuple[Path, int] | None:
    """(HF export dir, step) when ``model_path`` is a checkpoint or a directory of checkpoints;
    None for any other model. Exits 2 when a checkpoint holds no export."""
    from easyvlm.trainer.checkpoint import HF_EXPORT_DIR, CheckpointError, checkpoint_info, resolve_checkpoint

    path = Path(model_path)
    if not path.is_dir() or (path / "config.json").is_file():  # not a directory, or a model directory
        return None
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointError:
        return None
    export = checkpoint / HF_EXPORT_DIR
    if not (export / "config.json").is_file():
        exit_with_problems([Problem("worker.actor.model.model_path", f"the checkpoint {checkpoint} holds no Hugging Face export ({export}); a checkpoint of this version of easyvlm always does: point at an exported model directory instead")])
    return export, int(checkpoint_info(checkpoint)["step"])


def prepare(argv: Sequence[str]) -> tuple[Any, int, Path]:
    """argv -> (run plan, step the seeds use, output directory); exits 2 on any config problem."""
    from easyvlm.trainer.main import plan_run

    argv = [*argv, "trainer.val_only=true"]
    cfg = parse_and_validate(argv)
    found = checkpoint_model(cfg.worker.actor.model.model_path)
    step, out_dir = 0, None
    if found is not None:
        export, step = found
        argv.append(f"worker.actor.model.model_path={export}")
        out_dir = export.parents[1] / EVAL_DIR  # <checkpoint>/eval
    plan = plan_run(argv)
    if out_dir is None:
        out_dir = Path(plan.derived.save_checkpoint_path) / EVAL_DIR
    return plan, step, out_dir


def evaluate(plan: Any, step: int, out_dir: Path) -> dict[str, Any]:
    from tqdm import tqdm

    from easyvlm.data.dataloader import create_val_loader
    from easyvlm.eval.metrics import group_metrics
    from easyvlm.rewards.actor import build_reward_inputs
    from easyvlm.rewards.manager import RewardManager
    from easyvlm.rollout.factory import build_rollout
    from easyvlm.trainer.core import validation_prompts
    from easyvlm.trainer.metrics import val_metrics
    from easyvlm.viewer.pages import write_page
    from easyvlm.viewer.records import build_samples, capture_rollouts, is_correct

    cfg, bundle = plan.config, plan.bundle
    sampling = plan.rollout.val_sampling
    if not plan.rollout.per_request_seed:
        print("easyvlm: note: worker.rollout.per_request_seed is off: the samples depend on the engine's random "
              "stream and differ from the trainer's validation (turn it on in both to compare)", file=sys.stderr)
    loader = create_val_loader(cfg.data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config)
    engine = build_rollout(plan.rollout)
    rewards = RewardManager(plan.reward)
    scores: dict[str, list[float]] = {}
    correct: dict[str, list[bool]] = {}
    samples = []
    root = out_dir / "rollouts"
    try:
        for index, prompts in enumerate(tqdm(loader, desc="easyvlm eval", unit="batch", file=sys.stderr)):
            prompts = validation_prompts(prompts, plan.rollout.per_request_seed, cfg.worker.rollout.seed, step, index)
            engine.wake_up()
            batch = engine.generate(prompts, sampling)
            result = rewards.compute(build_reward_inputs(batch, bundle.tokenizer, cfg.worker.reward.skip_special_tokens))
            for key, values in result.scores.items():
                scores.setdefault(key, []).extend(values)
            for i, uid in enumerate(batch["uid"]):
                correct.setdefault(str(uid), []).append(is_correct({k: v[i] for k, v in result.scores.items()}))
            capture = capture_rollouts(step, "eval", batch, result.scores, result.overall)
            samples += build_samples(capture, bundle.tokenizer, root, cfg.worker.reward.skip_special_tokens)
    finally:
        rewards.close()
    summary: dict[str, Any] = {
        "model": cfg.worker.actor.model.model_path,
        "data": cfg.data.val_files,
        "step": step,
        "k": sampling.n,
        "prompts": len(correct),
        "samples": sum(len(c) for c in correct.values()),
        **group_metrics(list(correct.values())),
        **val_metrics(scores),
    }
    page = write_page(samples, root, f"eval_step_{step}", f"evaluation, step {step}: {Path(cfg.data.val_files).name}")
    summary["viewer"] = str(page)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from easyvlm.data.loading import DataError

    plan, step, out_dir = prepare(sys.argv[1:] if argv is None else argv)
    try:
        summary = evaluate(plan, step, out_dir)
    except DataError as err:
        sys.stderr.write(f"easyvlm: data error: {err}\n")
        sys.exit(2)
    print(json.dumps(summary), flush=True)
    return summary
