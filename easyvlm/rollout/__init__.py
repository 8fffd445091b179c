"""Rollout: sample responses for prompt Batches (vLLM or transformers generate) and sync weights."""

from easyvlm.rollout.base import RolloutEngine, Sampling, SamplingOverrides
from easyvlm.rollout.factory import build_rollout, sampling_from_config

__all__ = ["RolloutEngine", "Sampling", "SamplingOverrides", "build_rollout", "sampling_from_config"]
