"""The settings of a role's model, declared once: which model and tokenizer, how it loads (config
overrides, remote code, the attention and MoE experts kernels), what trains (gradient checkpointing,
a frozen vision tower) and the LoRA adapters. The config schema composes them as the sections
``worker.actor.model`` and ``worker.critic.model`` (``model.lora`` within); the reward-model trainer's
``model`` section is the same class. Torch-free: the config check imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 = no LoRA (full fine-tuning), > 0 trains LoRA adapters only."""
    alpha: int = 64
    """LoRA alpha (scale = alpha / rank)."""
    target_modules: str = "all-linear"
    """Modules that get adapters: `all-linear`, or a regular expression matched against full
    module names (peft's meaning of a string)."""
    exclude_modules: Optional[str] = None
    """Regular expression of modules that get no adapter, e.g. `.*visual.*` to leave the vision
    tower alone."""
    merge_for_rollout: Optional[bool] = None
    """easyvlm extra. How the rollout engine gets the adapters at each weight sync. null: unmerged
    (the engine holds the base weights, sent once, and applies the adapters it gets each step)
    where the engine serves every adapted module, else merged, with the reason printed at start;
    true: merged, W + alpha/rank B A, the whole model each step (EasyR1's way); false: unmerged,
    refused where the engine cannot (docs/rollout.md, "Weight sync")."""


@dataclass(frozen=True)
class ModelConfig:
    model_path: Optional[str] = None
    """Model to train: `builtin:tiny-qwen2.5-vl`, a local directory in Hugging Face format, or a
    hub id `org/name` (needs a network)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer and processor; None = `model_path`."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values that override the model's `config.json` when it is loaded."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the model repository. Default differs from EasyR1
    (True): running code from a model repo is a security decision the user should make
    explicitly; Qwen2.5-VL needs no remote code."""
    freeze_vision_tower: bool = False
    """Train the language model only; the vision encoder's weights stay fixed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """easyvlm extra. Attention kernel: sdpa runs everywhere (CPU included); flash_attention_2 is
    the fast choice on GPUs with flash-attn installed."""
    experts_implementation: Optional[Literal["grouped_mm", "eager"]] = None
    """easyvlm extra (transformers' `experts_implementation`). MoE models: how each layer's experts
    compute. grouped_mm: one grouped matrix product per projection for all experts
    (`torch.nn.functional.grouped_mm`); eager: transformers' loop, one product per expert hit. Equal
    within float rounding (docs/models.md). None = grouped_mm (transformers' own default). Expert
    parallelism computes its local experts as grouped products. A value is refused for dense models."""
