"""Before the workers start on a cluster the driver joined: every node builds the builtin models
the run names into its own cache (``$EASYVLM_CACHE`` of its ``ray start``).

Workers and engines only look models up (easyvlm.models.paths.local_model_dir); building one is
the driver's decision, made here once per node, so no worker or engine start turns into a build.
"""

from __future__ import annotations

from typing import Any

from easyvlm.builtin.models import BUILTIN_PREFIX, build_in_subprocess
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
