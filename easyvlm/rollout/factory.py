"""``build_rollout``: the RolloutEngine of a `RolloutSpec` (vllm imported lazily)."""

from __future__ import annotations

from easyvlm.rollout.base import RolloutEngine
from easyvlm.rollout.specs import RolloutSpec


def build_rollout(spec: RolloutSpec) -> RolloutEngine:
    """The engine ``spec.engine.name`` names, loading the model's files on this machine
    (``easyvlm.models.paths.local_model_dir``); the actor's weights arrive later through ``update_weights``."""
    if spec.engine.name == "vllm":
        from easyvlm.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(spec)
    assert spec.engine.name == "hf", spec.engine.name
    from easyvlm.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(spec)
