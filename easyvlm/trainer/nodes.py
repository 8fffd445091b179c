"""Before the workers start on a cluster the driver joined: every node builds the builtin models
the run names into its own cache (``$EASYVLM_CACHE`` of its ``ray start``).

Workers and engines only look models up (easyvlm.models.paths.local_model_dir); building one is
the driver's decision, made here once per node, so no worker or engine start turns into a build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from easyvlm.builtin.models import BUILTIN_PREFIX, model_cache_dir
from easyvlm.models.paths import ModelNotFoundError
from easyvlm.utils.cache import cache_root
from easyvlm.plan.build import RunPlan


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
    """``materialize_model(name)`` in a new Python process: the build's memory goes back when it
    ends, and transformers' ``save_pretrained``, which writes only on rank 0 of an initialised
    torch.distributed group, writes there whatever the caller's process group."""
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
    """Build the run's builtin models on every alive node of the joined cluster (a no-op where they
    exist: the build is keyed by name and version, the check costs a directory lookup)."""
    names = builtin_models(plan)
    if not names:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    build = ray.remote(num_cpus=0)(_build_here)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    ray.get([build.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(names)
             for node in nodes])
