"""From a command line to the processes of a run, shared by the trainer, ``easyvlm.eval`` and
``easyvlm.rm`` (torchrun, no Ray: only the environment check).

Everything a user can get wrong (environment, config, what needs the model's files or the device)
exits 2 with ``easyvlm: ... error:`` before anything heavy starts. ``start_ray`` starts or joins a
cluster, each node building the builtin models the run loads (``prepare_nodes``); ``rank_resources``
says what each rank of a worker group gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.builtin.models import BUILTIN_PREFIX, model_cache_dir
from easyvlm.config.cli import EXIT_CONFIG_ERROR, exit_with_problems, parse_and_validate
from easyvlm.config.errors import ConfigError
from easyvlm.config.schema import PPOConfig
from easyvlm.models.cpu_linear import onednn_linear_available
from easyvlm.models.kernel_choice import ISA_VARIABLES
from easyvlm.models.paths import ModelNotFoundError
from easyvlm.plan.build import RunPlan, build_plan, pick_device
from easyvlm.utils.cache import cache_root

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


# ------------------------------------------------------------------------------ argv -> run plan
def check_environment() -> None:
    """Exit 2 on a bad ``EASYVLM_CPU_LINEAR``: here, not in the workers."""
    try:
        onednn_linear_available()
    except ValueError as err:
        sys.stderr.write(f"easyvlm: environment error: {err}\n")
        sys.exit(EXIT_CONFIG_ERROR)


def plan_run(argv: Sequence[str]) -> RunPlan:
    """argv -> the run plan, or exit 2 with every problem found (environment, config, model files, device)."""
    check_environment()
    return plan_config(parse_and_validate(argv))


def plan_config(cfg: PPOConfig) -> RunPlan:
    """A validated config -> the run plan, or exit 2 with the problems that need the model's files or
    the device; the plan's notices go to stderr."""
    try:
        plan = build_plan(cfg, pick_device(cfg))
    except ConfigError as err:
        exit_with_problems(err.problems)
    for line in plan.notices:
        sys.stderr.write(f"easyvlm: note: {line}\n")
    return plan


# ------------------------------------------------------------------------------ Ray and resources
def start_ray(plan: RunPlan) -> Any:
    """Join ``trainer.ray_address`` / ``RAY_ADDRESS`` if given, else start a local cluster."""
    import ray

    launch = plan.launch
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-call INFO/WARNING lines drown the progress bar
    address = launch.ray_address or os.environ.get("RAY_ADDRESS")
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
        cpus = max(os.cpu_count() or 1, launch.n_gpus_per_node) + plan.driver.reward_num_cpus
        cpus += launch.judge_engines  # one per judge engine
        # the separate rollout group's devices, as many CPUs as a rank's
        cpus += launch.separate_rollout_devices * max(1, (os.cpu_count() or 1) // launch.n_gpus_per_node)
        # every easyvlm process is an actor started on demand: no idle workers started ahead (~80 MiB each)
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env={"env_vars": env},
                 _system_config={"prestart_worker_first_driver": False})
    return ray


def rank_resources(plan: RunPlan) -> Any:
    """What each rank of a worker group gets: a GPU, or on the CPU an equal share of the cores."""
    from easyvlm.distributed.worker_group import Resources

    cpus_per_worker = max(1, (os.cpu_count() or 1) // plan.launch.n_gpus_per_node) if plan.device == "cpu" else 4
    return Resources(world_size=plan.launch.world_size, cpus_per_worker=cpus_per_worker, use_gpu=plan.device == "cuda")


# ------------------------------------------------------------------------------ a joined cluster's nodes
def builtin_models(plan: RunPlan) -> list[str]:
    """The builtin model names (without the prefix) that some worker of the run loads."""
    paths = [plan.actor.model.model_path, plan.bundle.tokenizer_path]
    if plan.critic is not None:
        paths.append(plan.critic.model.model_path)
    if plan.reward_model is not None:
        paths.append(plan.reward_model.model.model_path)
    if plan.judge is not None:
        paths += [plan.judge.rollout.engine.model_path, plan.judge.rollout.engine.tokenizer_path]
    names = {path[len(BUILTIN_PREFIX):] for path in paths if path.startswith(BUILTIN_PREFIX)}
    return sorted(names)


def build_in_subprocess(name: str) -> Path:
    """``materialize_model(name)`` in a new process: its memory goes back when it ends, and
    ``save_pretrained`` (which writes only on rank 0 of a process group) always writes."""
    target = model_cache_dir(name)
    if target.is_dir():
        return target
    scrubbed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in scrubbed}
    done = subprocess.run([sys.executable, "-m", "easyvlm.builtin.models", name], env=env, capture_output=True, text=True)
    if done.returncode != 0 or not target.is_dir():
        raise ModelNotFoundError(
            f"building {BUILTIN_PREFIX}{name} into this node's cache ({cache_root()}) failed "
            f"(python -m easyvlm.builtin.models {name}, exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return target


def _build_here(names: list[str]) -> list[str]:
    """The directories of ``names`` on the node that runs this (built first where missing)."""
    return [str(build_in_subprocess(name)) for name in names]


def prepare_nodes(plan: RunPlan, ray: Any) -> None:
    """Build the run's builtin models on every alive node of the joined cluster (no-op where they exist)."""
    names = builtin_models(plan)
    if not names:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    build = ray.remote(num_cpus=0)(_build_here)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    ray.get([build.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(names)
             for node in nodes])
