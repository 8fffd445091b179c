"""Rollout: sample responses for prompt Batches (vLLM or transformers generate) and sync weights."""

from easyvlm.rollout.base import RolloutEngine, sampling_with_overrides
from easyvlm.rollout.factory import build_rollout

__all__ = ["RolloutEngine", "build_rollout", "sampling_with_overrides"]
