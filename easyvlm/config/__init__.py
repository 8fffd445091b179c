"""Typed configuration: schema (dataclasses), loading (YAML + overrides), validation, derived values.

    from easyvlm.config import load_config, validate, derive
    cfg = load_config(["config=examples/config.yaml", "worker.rollout.n=8"])
    validate(cfg)            # ConfigError listing every problem
    derived = derive(cfg)    # world size, per-device batch sizes, total steps, ...
"""

from easyvlm.config.derived import Derived, RoleBatching, derive
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.loader import apply_overrides, load_config, to_yaml
from easyvlm.config.schema import DataConfig, PPOConfig, TrainerConfig
from easyvlm.config.worker_schema import RewardConfig, RolloutConfig, WorkerConfig
from easyvlm.config.validate import find_problems, validate
from easyvlm.algorithms.settings import AlgorithmConfig
from easyvlm.models.settings import LoraConfig, ModelConfig
from easyvlm.rewards.settings import RewardFunctionConfig
from easyvlm.workers.settings import ActorConfig, CriticConfig, FSDPConfig, OffloadConfig, OptimConfig, RefConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "Derived",
    "FSDPConfig",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "PPOConfig",
    "Problem",
    "RefConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RoleBatching",
    "RolloutConfig",
    "TrainerConfig",
    "WorkerConfig",
    "apply_overrides",
    "derive",
    "find_problems",
    "load_config",
    "to_yaml",
    "validate",
]
