"""Entry point: ``python -m easyvlm.trainer.main config=examples/config.yaml key=value ...``

Everything that can be wrong with a run is found before Ray starts, and reported as
``easyvlm: config error:`` (or ``data error:``) with exit status 2 and no traceback:

1. parse and validate the config (``easyvlm.config``);
2. build the run plan: paths resolved, the model's config, tokenizer and processor loaded once,
   the checks that need the model or the device (``easyvlm.plan.build``);
3. load every reward file and check its function; read the data sets (every row encoded once);
   find the checkpoint to resume from and check it;
4. start Ray locally, or join a cluster (``trainer.ray_address`` or ``RAY_ADDRESS``), build the
   workers from the plan and run the loop.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.config.cli import exit_with_problems, parse_and_validate
from easyvlm.config.errors import ConfigError
from easyvlm.models.cpu_linear import onednn_linear_available
from easyvlm.models.kernel_choice import ISA_VARIABLES
from easyvlm.plan.build import RunPlan, build_plan, pick_device
from easyvlm.trainer.nodes import prepare_nodes

# what Ray workers need to see from the driver's environment (on a cluster joined through an
# address, without _NODE_PATHS: paths of the driver's machine; each node has its own)
_FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "EASYVLM_CACHE",
    "TOKENIZERS_PARALLELISM",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_LOGGING_LEVEL",
    "PYTHONPATH",
    "OMP_NUM_THREADS",  # torch threads per CPU rank (easyvlm.distributed.worker_group.cpu_threads)
    "EASYVLM_CPU_LINEAR",  # auto / onednn / aten: the CPU linears' kernel (easyvlm.models.cpu_linear)
    *ISA_VARIABLES,  # oneDNN's and MKL's vector-ISA caps (e.g. AVX2 on an AVX-512 CPU), read at their start
)
_NODE_PATHS = ("HF_HOME", "EASYVLM_CACHE", "PYTHONPATH")
EXIT_DATA_ERROR = 2


def start_ray(plan: RunPlan) -> Any:
    """Join ``trainer.ray_address`` / ``RAY_ADDRESS`` if given, else start a local cluster."""
    import ray

    cfg = plan.config
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-call INFO/WARNING lines drown the progress bar
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return ray
    if address:
        # the nodes' caches and import paths are their own (set by each node's `ray start`): builtin
        # models are built on each node, hub models come from each node's cache, reward and loss files
        # travel in the run plan
        env = {k: v for k, v in env.items() if k not in _NODE_PATHS}
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        prepare_nodes(plan, ray)  # each node's cache gets the builtin models before any worker starts
    else:
        # logical CPUs: one per training process plus the reward actor's; the OS shares the cores
        cpus = max(os.cpu_count() or 1, cfg.trainer.n_gpus_per_node) + cfg.worker.reward.num_cpus
        cpus += cfg.worker.judge.num_workers if cfg.worker.judge.enable else 0  # one per judge engine
        if cfg.worker.rollout.placement == "separate":  # the rollout group's devices, as many CPUs as a rank's
            cpus += cfg.worker.rollout.num_devices * max(1, (os.cpu_count() or 1) // cfg.trainer.n_gpus_per_node)
        # every easyvlm process is an actor started on demand: no idle workers started ahead (~80 MiB each)
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env={"env_vars": env},
                 _system_config={"prestart_worker_first_driver": False})
    return ray


def rank_resources(plan: RunPlan) -> Any:
    """What each rank of a worker group gets: a GPU, or on the CPU an equal share of the cores."""
    from easyvlm.distributed.worker_group import Resources

    cpus_per_worker = max(1, (os.cpu_count() or 1) // plan.config.trainer.n_gpus_per_node) if plan.device == "cpu" else 4
    return Resources(world_size=plan.derived.world_size, cpus_per_worker=cpus_per_worker, use_gpu=plan.device == "cuda")


def plan_run(argv: Sequence[str]) -> RunPlan:
    """argv -> the run plan, or exit 2 with every problem found (config, model files, device)."""
    try:
        onednn_linear_available()  # a bad EASYVLM_CPU_LINEAR stops here, not in the workers
    except ValueError as err:
        sys.stderr.write(f"easyvlm: environment error: {err}\n")
        sys.exit(EXIT_DATA_ERROR)
    cfg = parse_and_validate(argv)
    try:
        plan = build_plan(cfg, pick_device(cfg))
    except ConfigError as err:
        exit_with_problems(err.problems)
    for line in plan.notices:
        sys.stderr.write(f"easyvlm: note: {line}\n")
    return plan


def open_tracker_or_exit(plan: RunPlan, num_train_prompts: int, resume_from: Path | None) -> Any:
    """The run's trackers, opened before Ray starts: a tracker that cannot start (a tracking URI it
    cannot use, a log directory it cannot write) is reported here, exit 2, before anything heavy."""
    from easyvlm.run.checkpoint import checkpoint_info
    from easyvlm.trainer.loop import open_tracker

    start_step = int(checkpoint_info(resume_from)["step"]) if resume_from is not None else 0
    try:
        return open_tracker(plan, plan.derived.total_steps(num_train_prompts), start_step)
    except Exception as err:  # noqa: BLE001 - each tracker library raises its own errors
        loggers = ", ".join(plan.driver.records.loggers)
        sys.stderr.write(f"easyvlm: tracker error (trainer.logger: {loggers}): {type(err).__name__}: {err}\n")
        sys.exit(EXIT_DATA_ERROR)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    return run(plan_run(sys.argv[1:] if argv is None else argv))


def run(plan: RunPlan) -> dict[str, float]:
    """Steps 3 and 4 for a run plan (``plan_run``'s, or one a bench script changed: e.g.
    bench/router_replay_gap.py runs the CPU's vLLM engine in bf16); returns the final metrics."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from easyvlm.plan.dataloaders import plan_dataloaders
    from easyvlm.data.loading import DataError
    from easyvlm.run.checkpoint import CheckpointError, resume_checkpoint
    from easyvlm.trainer.loop import Trainer

    try:
        train_loader, val_loader = plan_dataloaders(plan)
        resume_from = resume_checkpoint(plan.config.trainer, Path(plan.derived.save_checkpoint_path))
    except (DataError, CheckpointError) as err:
        sys.stderr.write(f"easyvlm: {'data' if isinstance(err, DataError) else 'checkpoint'} error: {err}\n")
        sys.exit(EXIT_DATA_ERROR)
    except ConfigError as err:
        exit_with_problems(err.problems)
    tracker = open_tracker_or_exit(plan, len(train_loader.dataset), resume_from)
    try:
        ray = start_ray(plan)
        if plan.config.trainer.device == "auto" and plan.device == "cpu" and ray.cluster_resources().get("GPU", 0) > 0:
            plan = build_plan(plan.config, "cuda")  # a GPU cluster joined from a machine without one
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
