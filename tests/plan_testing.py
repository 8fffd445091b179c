"""Run plans for tests: a valid config around the tiny model, turned into the roles' specs by the real
plan builder (``easyvlm.plan.build``), so tests build workers exactly as the trainer does."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# A small valid run: 1 rank, n = 1, the synthetic reward file of the repository.
BASE_OVERRIDES = (
    "data.train_files=builtin:synthetic@train",
    "data.val_files=",
    "trainer.val_before_train=false",
    "data.max_prompt_length=256",
    "data.max_response_length=32",
    "worker.rollout.n=1",
    "algorithm.adv_estimator=reinforce_plus_plus",  # works with one sample per prompt
    "worker.rollout.name=hf",
    "worker.actor.micro_batch_size_per_device_for_update=2",
    "worker.actor.micro_batch_size_per_device_for_experience=2",
    "worker.actor.dynamic_batching=false",
    "worker.actor.use_torch_compile=false",  # tests/workers/test_actor.py checks compiled = eager once
    "worker.actor.model.enable_gradient_checkpointing=false",
    "worker.actor.optim.lr=1e-3",
    "worker.critic.micro_batch_size_per_device_for_update=1",
    "worker.critic.micro_batch_size_per_device_for_experience=2",
    "worker.critic.dynamic_batching=false",
    "worker.critic.model.enable_gradient_checkpointing=false",
    "worker.critic.optim.lr=1e-3",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[file]",
)


def config_for(model_path: str, *overrides: str) -> Any:
    """A validated `PPOConfig` with ``model_path`` as policy (and critic) and ``overrides`` applied."""
    from easyvlm.config.loader import load_config
    from easyvlm.config.validate import validate

    args = [
        *BASE_OVERRIDES,
        f"worker.actor.model.model_path={model_path}",
        f"worker.critic.model.model_path={model_path}",
        f"worker.reward.reward_function={REPO / 'reward_functions' / 'synthetic.py'}:compute_score",
        "data.rollout_batch_size=24",  # a multiple of every global_batch_size the tests use (1-4, 6, 8)
        "worker.actor.global_batch_size=4",
        "worker.critic.global_batch_size=4",
        *overrides,
    ]
    cfg = load_config(args)
    validate(cfg)
    return cfg


def plan_for(model_path: str, *overrides: str, total_steps: int = 10, device: str = "cpu") -> Any:
    """The `RunPlan` of :func:`config_for`, with the trained roles' schedule length set."""
    from easyvlm.plan.build import build_plan
    from easyvlm.plan.roles import with_total_steps

    plan = build_plan(config_for(model_path, *overrides), device)
    return dataclasses.replace(
        plan,
        actor=with_total_steps(plan.actor, total_steps),
        critic=with_total_steps(plan.critic, total_steps) if plan.critic is not None else None,
    )

