"""``build_rollout``: the RolloutEngine of a `RolloutSpec` (vllm imported lazily)."""

from __future__ import annotations

from easyvlm.rollout.base import RolloutEngine
from easyvlm.rollout.specs import RolloutSpec


def build_rollout(spec: RolloutSpec) -> RolloutEngine:
    """The engine ``spec.engine.generation.name`` names, with this machine's model files (weights come later)."""
    if spec.engine.generation.name == "vllm":
        from easyvlm.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(spec)
    assert spec.engine.generation.name == "hf", spec.engine.generation.name
    from easyvlm.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(spec)
