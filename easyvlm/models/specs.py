"""The run plan's model slices: ``ModelSpec`` (how a worker builds a model), ``ModelBundle`` (the policy's files,
loaded once in the driver, with the agreed token ids). Frozen, final values made by ``easyvlm.plan.models``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of the policy (``worker.actor.model.lora`` with rank > 0)."""

    rank: int
    alpha: int
    target_modules: str | tuple[str, ...]
    """``"all-linear"``, a regular expression of full module names, or module names (a tuple)."""
    exclude_modules: Optional[str]
    """Regular expression of modules left without adapters, or None."""


@dataclass(frozen=True)
class ModelSpec:
    """How a worker builds one model; resolved in the driver."""

    model_dir: str
    """A local model directory (``builtin:`` names and hub ids already resolved)."""
    hf_config: Any
    """The transformers config with ``model.override_config`` applied (loaded once, in the driver)."""
    trust_remote_code: bool
    attn_implementation: str
    """As requested (``sdpa``, ``eager``, ``flash_attention_2``/``_3``; flash falls back to sdpa on the CPU)."""
    lora: Optional[LoraSpec]
    """None: no adapters (full fine-tuning, and always for the reference model and the critic)."""
    freeze_vision_tower: bool
    gradient_checkpointing: bool
    experts_implementation: Optional[str] = None
    """MoE models: transformers' ``experts_implementation`` (grouped_mm, eager); None = grouped_mm."""
    model_path: str = ""
    """The model as the config names it; "" = only ``model_dir`` is known. Workers load
    ``easyvlm.models.paths.local_model_dir(model_dir, model_path)``."""


@dataclass(frozen=True)
class TokenIds:
    """Token ids every role agrees on, read once from the tokenizer and the model config."""

    pad: int
    """Fills prompts on the left and responses after their end."""
    eos: tuple[int, ...]
    """End a response: the tokenizer's EOS plus the generation config's."""
    blocked: tuple[int, ...]
    """Never sampled (vision placeholders, padded LM-head rows); log-probs use the same reduced vocabulary."""


@dataclass(frozen=True)
class ModelBundle:
    """The policy's files, resolved and loaded once in the driver (``trust_remote_code`` honoured)."""

    policy: ModelSpec
    tokenizer: Any
    processor: Any
    """The multimodal processor, or None for a text-only model."""
    generation_config: Any
    """The model directory's ``generation_config.json`` (EOS ids, what an HF export keeps), or None."""
    tokens: TokenIds
    tokenizer_dir: str
    """Where the tokenizer and processor were loaded from (default: the model directory)."""
    tokenizer_path: str = ""
    """``tokenizer_dir`` as the config names it (see `ModelSpec.model_path`)."""
