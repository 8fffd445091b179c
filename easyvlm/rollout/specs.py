"""The run plan's slices for generation (`EngineSpec`, `Sampling`, `RolloutSpec`): plain frozen
dataclasses, torch-free. ``easyvlm.plan.roles`` makes them; ``easyvlm.rollout.factory`` builds the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from easyvlm.models.specs import LoraSpec, TokenIds
from easyvlm.rollout.settings import GenerationSettings


@dataclass(frozen=True)
class AdapterSpec:
    """The policy's LoRA adapters, served unmerged: the engine holds the base weights (sent once) and
    applies the adapters each sync sends (``worker.actor.model.lora.merge_for_rollout``)."""

    lora: LoraSpec  # the actor's adapters (the transformers engine wraps its model with them)
    max_rank: int  # vLLM's max_lora_rank: the smallest it takes that holds the rank
    tower: bool  # adapters on the vision tower train: vLLM's enable_tower_connector_lora


@dataclass(frozen=True)
class EngineSpec:
    """The generation engine (what validation shares with training): its keys as the config gives
    them (``generation``), and what the plan resolves from them and from the policy."""

    generation: GenerationSettings
    """``worker.rollout``'s engine and sampling keys, whole. The engine reads its own from here (name,
    seed, gpu_memory_utilization, enforce_eager, ...); ``dtype``, ``max_model_len`` and
    ``max_num_seqs`` it reads resolved, below."""
    model_dir: str
    hf_config: Any
    hf_config_overrides: dict  # worker.actor.model.override_config: vLLM loads the model dir itself, then these
    tokenizer_dir: str
    """The policy's tokenizer and processor (``worker.actor.model.tokenizer_path``, resolved): vLLM's
    multimodal processor comes from here, as the data pipeline's does."""
    trust_remote_code: bool  # for the engine's own loading of model and processor
    device: str  # cpu or cuda
    dtype: str  # generation.dtype canonical: bf16, fp16 or fp32 (the CPU runs cpu_dtype whatever it says)
    max_model_len: int  # generation.max_model_len, or the work's (Derived.rollout_max_model_len)
    max_num_seqs: int  # generation.max_num_seqs, or the work's (Derived.rollout_max_num_seqs)
    mm_processor_kwargs: dict = field(default_factory=dict)  # vLLM's image sizes = the data pipeline's
    sequence_tokens: int = 0
    """The longest a request gets, prompt and response (data.max_prompt_length +
    data.max_response_length); the CPU KV cache holds ``max_num_seqs`` of them. 0 = ``max_model_len``."""
    model_path: str = ""
    tokenizer_path: str = ""
    """``model_dir`` and ``tokenizer_dir`` as the config names them (see `ModelSpec.model_path`);
    the engine loads this node's copies (``easyvlm.models.paths.local_model_dir``)."""
    record_routing: bool = False  # router_replay=R3: the engine returns each token's routed_experts
    cpu_dtype: str = "fp32"
    """The vLLM engine's dtype on the CPU: fp32, so that its log-probs match the float32 actor's. No
    config key sets another (``bench/router_replay_gap.py`` sets bf16)."""
    lora: Optional[AdapterSpec] = None  # None: the engine takes full (merged) weights


@dataclass(frozen=True)
class Sampling:
    """The sampling settings of one generate() call, resolved in the driver (the run plan holds the
    training and the validation ones; easyvlm.rollout.base checks them and applies overrides)."""

    n: int  # samples per prompt (G)
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # -1 = no top-k
    max_tokens: int  # at most the engine's response length; responses are still padded to it
    ignore_eos: bool
    extra: tuple[tuple[str, Any], ...] = ()
    """Further fields of vLLM's ``SamplingParams`` (``worker.rollout.val_override_config``: min_p,
    repetition_penalty, stop, ...), as (name, value) pairs; the transformers engine takes none."""


@dataclass(frozen=True)
class RolloutSpec:
    engine: EngineSpec
    sampling: Sampling  # training: worker.rollout.*, max tokens = data.max_response_length
    val_sampling: Sampling  # training's with worker.rollout.val_override_config applied
    response_length: int
    tokens: TokenIds
    per_request_seed: bool
