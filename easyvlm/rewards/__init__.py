"""Verifiable rewards (docs/rewards.md). ``easyvlm.rewards.actor`` (torch, ray) is not imported here,
so worker processes that import this package start fast."""

from easyvlm.rewards.loader import RewardFunctionSpec, load_reward_function
from easyvlm.rewards.manager import RewardManager, RewardSettings
from easyvlm.rewards.types import RewardError, RewardInput, RewardResult

__all__ = [
    "RewardError",
    "RewardFunctionSpec",
    "RewardInput",
    "RewardManager",
    "RewardResult",
    "RewardSettings",
    "load_reward_function",
]
