"""``python -m easyvlm.eval config=... worker.actor.model.model_path=<model> data.val_files=...``: k =
``worker.rollout.val_override_config.n`` answers per prompt, scored by the trainer's validation pipeline;
mean@k, pass@k and every reward key, overall and per data file, go to ``<checkpoint or run dir>/eval/`` and
the last stdout line. Config errors exit 2 before any model loads. docs/eval.md."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.config.cli import exit_with_problems, parse_and_validate
from easyvlm.config.errors import Problem

EVAL_DIR = "eval"


def checkpoint_model(model_path: str) -> tuple[Path, int] | None:
    """(HF export dir, step) when ``model_path`` is a checkpoint or a directory of checkpoints, None for
    any other model. Exits 2 for a directory that is neither, a checkpoint without an export, or an
    export that fails the checkpoint's manifest."""
    from easyvlm.run.checkpoint import HF_EXPORT_DIR, MANIFEST, CheckpointError, checkpoint_info, resolve_checkpoint, verify_checkpoint

    key = "worker.actor.model.model_path"
    path = Path(model_path)
    if not path.is_dir() or (path / "config.json").is_file():  # not a directory, or a model directory
        return None
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointError:
        exit_with_problems([Problem(key, f"{model_path!r} is neither a model directory (no config.json) nor a complete checkpoint (global_step_<N> holding COMPLETE) nor a directory of checkpoints: point at one of these")])
    export = checkpoint / HF_EXPORT_DIR
    if not (export / "config.json").is_file():
        exit_with_problems([Problem(key, f"the checkpoint {checkpoint} holds no Hugging Face export ({export}); a checkpoint of this version of easyvlm always does: point at an exported model directory instead")])
    if (checkpoint / MANIFEST).is_file():  # older checkpoints have none; their export is safetensors all the same
        try:
            verify_checkpoint(checkpoint, under=HF_EXPORT_DIR)
        except CheckpointError as err:
            exit_with_problems([Problem(key, str(err))])
    return export, int(checkpoint_info(checkpoint)["step"])


def with_model_path(cfg: Any, model_path: str) -> Any:
    """``cfg`` with ``worker.actor.model.model_path`` replaced (the config's dataclasses are frozen)."""
    actor = cfg.worker.actor
    model = dataclasses.replace(actor.model, model_path=model_path)
    return dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, actor=dataclasses.replace(actor, model=model)))


def prepare(argv: Sequence[str]) -> tuple[Any, int, Path, Path | None]:
    """argv -> (run plan, step the seeds use, output directory, checkpoint or None); exits 2 on any
    config problem. A checkpoint's export replaces the checkpoint as the model."""
    from easyvlm.models.paths import ModelNotFoundError
    from easyvlm.plan.launch import check_environment, plan_config

    cfg = parse_and_validate([*argv, "trainer.val_only=true"])
    found = checkpoint_model(cfg.worker.actor.model.model_path)
    step, out_dir, checkpoint = 0, None, None
    if found is not None:
        export, step = found
        checkpoint = export.parents[1]  # <checkpoint>/actor/huggingface
        cfg = with_model_path(cfg, str(export))
        out_dir = checkpoint / EVAL_DIR
    check_environment()
    try:
        plan = plan_config(cfg)
    except ModelNotFoundError as err:  # e.g. a hub id that is not in the cache with HF_HUB_OFFLINE=1
        exit_with_problems([Problem("worker.actor.model.model_path", str(err))])
    if out_dir is None:
        out_dir = Path(plan.driver.records.run_dir) / EVAL_DIR
    return plan, step, out_dir, checkpoint


def row_files(dataset: Any) -> dict[str, str]:
    """uid -> the data file of each prompt (``data.val_files`` may be a directory); uids are
    ``<name>-<number>`` as ``RLDataset.__getitem__`` makes them."""
    return {f"{dataset.name}-{number}": dataset.sources[source].label for source, _, number in dataset.index}


def report(rows: Sequence[tuple[str, str, dict[str, float]]]) -> dict[str, Any]:
    """Counts, mean@k, pass@k and the mean of every reward key (named as the trainer's validation names
    it) over answers given as (file, prompt uid, scores)."""
    from easyvlm.eval.metrics import group_metrics
    from easyvlm.pipeline.generate_and_score import val_metrics
    from easyvlm.viewer.records import is_correct

    correct: dict[str, list[bool]] = {}
    scores: dict[str, list[float]] = {}
    for _, uid, row in rows:
        correct.setdefault(uid, []).append(is_correct(row))
        for key, value in row.items():
            scores.setdefault(key, []).append(value)
    return {
        "prompts": len(correct),
        "samples": len(rows),
        **group_metrics(list(correct.values())),
        **val_metrics(scores),
    }


def evaluate(plan: Any, step: int, out_dir: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """Generate and score every prompt of ``data.val_files``; write the summary and the rollout pages.
    ``checkpoint``: the checkpoint evaluated, whose reward-model statistics are used."""
    import gc

    from tqdm import tqdm

    from easyvlm.agents.setup import DriverRollout
    from easyvlm.data.dataloader import create_val_loader
    from easyvlm.pipeline.generate_and_score import generate_and_score
    from easyvlm.pipeline.model_scorers import ModelScorers
    from easyvlm.pipeline.scoring import LocalRewards, Scorer
    from easyvlm.rewards.manager import RewardManager
    from easyvlm.rollout.factory import build_rollout
    from easyvlm.plan.launch import rank_resources, start_ray
    from easyvlm.viewer.pages import write_page
    from easyvlm.viewer.records import build_samples

    bundle, records = plan.bundle, plan.driver.records
    sampling = plan.rollout.val_sampling
    if not plan.rollout.per_request_seed:
        print("easyvlm: note: worker.rollout.per_request_seed is off: the samples depend on the engine's random "
              "stream and differ from the trainer's validation (turn it on in both to compare)", file=sys.stderr)
    # the trainer's validation loader: the same batches (vLLM's numerics depend on what is batched together)
    tools = plan.agent.tool_schemas if plan.agent is not None else ()
    loader = create_val_loader(plan.data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config, tools)
    skip_special = records.skip_special_tokens
    rewards = RewardManager(plan.reward)
    if plan.reward_model is not None or plan.judge is not None:  # both run in Ray processes
        start_ray(plan)  # the trainer's: a local cluster, or the one trainer.ray_address / RAY_ADDRESS names
    state = checkpoint / "trainer_state.pt" if checkpoint is not None else None
    models = ModelScorers(plan.reward_model, plan.judge, rank_resources(plan), state)
    engine = build_rollout(plan.rollout)
    rollout = DriverRollout(plan, loader.dataset.encoder, engine.generate)  # the trainer's turns, tools included

    def generate(prompts: Any, sampling: Any) -> Any:
        engine.wake_up()
        return rollout.generate(prompts, sampling)

    try:
        scorer = Scorer(LocalRewards(rewards), bundle.tokenizer, skip_special, models.scores, models.judge)
        batches = tqdm(loader, desc="easyvlm eval", unit="batch", file=sys.stderr)
        seed = plan.driver.rounds.seed if plan.rollout.per_request_seed else None
        scored = generate_and_score(batches, generate, sampling, scorer, step, "eval", seed, capture=True)
    finally:
        rewards.close()
        models.close()
        del engine, rollout  # vLLM holds the weights and its KV cache until collected
        gc.collect()
    files = row_files(loader.dataset)
    rows = [(files[uid], uid, {key: values[i] for key, values in scored.scores.items()}) for i, uid in enumerate(scored.uids)]
    root = out_dir / "rollouts"
    samples = [sample for capture in scored.captures for sample in build_samples(capture, bundle.tokenizer, root, skip_special)]
    summary: dict[str, Any] = {
        "model": plan.actor.model.model_path,
        "data": plan.data.val_files,
        "step": step,
        "k": sampling.n,
        **report(rows),
        "files": {file: report([r for r in rows if r[0] == file]) for file in dict.fromkeys(r[0] for r in rows)},
    }
    page = write_page(samples, root, f"eval_step_{step}", f"evaluation, step {step}: {Path(plan.data.val_files).name}")
    summary["viewer"] = str(page)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from easyvlm.data.loading import DataError

    plan, step, out_dir, checkpoint = prepare(sys.argv[1:] if argv is None else argv)
    try:
        summary = evaluate(plan, step, out_dir, checkpoint)
    except DataError as err:
        sys.stderr.write(f"easyvlm: data error: {err}\n")
        sys.exit(2)
    print(json.dumps(summary), flush=True)
    return summary
