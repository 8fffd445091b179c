"""Entry point: ``python -m easyvlm.trainer.main config=examples/config.yaml key=value ...``

Everything that can be wrong with a run (config, plan, reward files, data, checkpoint, trackers)
is reported before Ray starts as ``easyvlm: <kind> error:``, exit status 2, no traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.config.cli import exit_with_problems
from easyvlm.config.errors import ConfigError
from easyvlm.plan.build import RunPlan
from easyvlm.plan.launch import plan_run, rank_resources, start_ray

EXIT_DATA_ERROR = 2


def open_tracker_or_exit(plan: RunPlan, total_steps: int, resume_from: Path | None) -> Any:
    """The run's trackers, opened before Ray starts; one that cannot start exits 2 here."""
    from easyvlm.run.checkpoint import checkpoint_info
    from easyvlm.trainer.loop import open_tracker

    start_step = int(checkpoint_info(resume_from)["step"]) if resume_from is not None else 0
    try:
        return open_tracker(plan, total_steps, start_step)
    except Exception as err:  # noqa: BLE001 - each tracker library raises its own errors
        loggers = ", ".join(plan.driver.records.loggers)
        sys.stderr.write(f"easyvlm: tracker error (trainer.logger: {loggers}): {type(err).__name__}: {err}\n")
        sys.exit(EXIT_DATA_ERROR)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    return run(plan_run(sys.argv[1:] if argv is None else argv))


def run(plan: RunPlan) -> dict[str, float]:
    """Load data, rewards and checkpoint for a run plan (``plan_run``'s, or one a bench script
    changed), start Ray and train; returns the final metrics."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from easyvlm.plan.dataloaders import plan_dataloaders
    from easyvlm.data.loading import DataError
    from easyvlm.run.checkpoint import CheckpointError, resume_checkpoint
    from easyvlm.trainer.loop import Trainer

    try:
        train_loader, val_loader = plan_dataloaders(plan)
        total_steps = plan.driver.length.total_steps(len(train_loader.dataset))  # ConfigError: not one step fits
        d = plan.driver
        resume_from = resume_checkpoint(d.load_checkpoint_path, d.find_last_checkpoint, Path(d.records.run_dir))
    except (DataError, CheckpointError) as err:
        sys.stderr.write(f"easyvlm: {'data' if isinstance(err, DataError) else 'checkpoint'} error: {err}\n")
        sys.exit(EXIT_DATA_ERROR)
    except ConfigError as err:
        exit_with_problems(err.problems)
    tracker = open_tracker_or_exit(plan, total_steps, resume_from)
    try:
        ray = start_ray(plan)
        if plan.for_cuda is not None and ray.cluster_resources().get("GPU", 0) > 0:
            plan = plan.for_cuda()  # a GPU cluster joined from a machine without one
        trainer = Trainer(plan, train_loader, val_loader, rank_resources(plan), resume_from, tracker=tracker)
    except BaseException:
        tracker.close()
        raise
    try:
        for line in trainer.placement():  # on a multi-node cluster: which node runs each rank
            sys.stderr.write(f"easyvlm: {line}\n")
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    print("easyvlm: done. final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith(("val/", "reward/"))))
    return metrics


if __name__ == "__main__":
    main()
