"""``build_rollout``: the RolloutEngine of a `RolloutSpec` (vllm imported lazily)."""

from __future__ import annotations

from easyvlm.models.paths import local_model_dir
from easyvlm.rollout.base import RolloutEngine
from easyvlm.specs import RolloutSpec


def build_rollout(spec: RolloutSpec) -> RolloutEngine:
    """The engine ``spec.engine.name`` names, loading the model's files on this machine
    (``easyvlm.models.paths.local_model_dir``); the actor's weights arrive later through ``update_weights``."""
    common = dict(
        sampling=spec.sampling,
        response_length=spec.response_length,
        pad_token_id=spec.tokens.pad,
        eos_token_ids=spec.tokens.eos,
        blocked_token_ids=spec.tokens.blocked,
    )
    if spec.engine.name == "vllm":
        from easyvlm.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(spec.engine, **common)
    assert spec.engine.name == "hf", spec.engine.name
    from easyvlm.rollout.hf import HFRolloutEngine

    engine = spec.engine
    return HFRolloutEngine(
        local_model_dir(engine.model_dir, engine.model_path),
        hf_config=engine.hf_config,
        trust_remote_code=engine.trust_remote_code,
        dtype=engine.dtype,
        device=engine.device,
        seed=engine.seed,
        micro_batch_size=engine.max_num_seqs,
        record_routing=engine.record_routing,
        **common,
    )
