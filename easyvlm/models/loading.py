"""Load the policy / reference / critic models, tokenizer and processor from a ``ModelConfig``.

Families: Qwen2-VL and Qwen2.5-VL (``AutoModelForImageTextToText``) and text-only causal LMs
(Qwen2, Qwen2.5, Qwen3, Llama-style: ``AutoModelForCausalLM``). The critic is
``AutoModelForTokenClassification`` with ``num_labels=1`` when transformers has that class for the
architecture (Qwen2/3, Llama), else :class:`ValueHeadModel`: the model's backbone
(``AutoModel``, e.g. ``Qwen2_5_VLModel``) plus a linear value head.

``trust_remote_code`` is off by default (EasyR1 turns it on): it runs Python code shipped with a
checkpoint, and every supported family is implemented in transformers itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from easyvlm.models.padding_free import VARLEN_ATTENTION, register_varlen_attention
from easyvlm.models.position_ids import MROPE_MODEL_TYPES

logger = logging.getLogger(__name__)

ModelRole = Literal["policy", "critic"]


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model` returns. ``hf_config`` is the (overridden) transformers config;
    ``is_vision_language``: the model takes pixel_values / image_grid_thw."""

    model: nn.Module
    hf_config: Any
    is_vision_language: bool


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def resolve_paths(model_config: Any) -> tuple[str, str]:
    """(model_dir, tokenizer_dir) after ``resolve_model_path`` (``builtin:``, local dir, hub id)."""
    from easyvlm.models.builtin import resolve_model_path

    model_path = _field(model_config, "model_path")
    if not model_path:
        raise ValueError(
            "worker.actor.model.model_path is empty: give a local directory, 'org/name' or 'builtin:<name>'"
        )
    model_dir = resolve_model_path(model_path)
    tokenizer_path = _field(model_config, "tokenizer_path") or model_path
    tokenizer_dir = model_dir if tokenizer_path == model_path else resolve_model_path(tokenizer_path)
    return model_dir, tokenizer_dir


def load_hf_config(model_dir: str, override_config: dict | None = None, trust_remote_code: bool = False) -> Any:
    """transformers config of ``model_dir`` with ``override_config`` applied (nested dicts for sub-configs)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    apply_config_overrides(config, override_config or {})
    return config


def apply_config_overrides(config: Any, overrides: dict, where: str = "model.override_config") -> None:
    """Set ``overrides`` on ``config`` in place; ``{"text_config": {...}}`` recurses into a sub-config."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_config_overrides(current, value, f"{where}.{key}")
            continue
        if not hasattr(config, key):
            # transformers configs accept any attribute; a typo would be silently ignored by the model
            logger.warning("%s.%s is not an attribute of %s; setting it anyway", where, key, type(config).__name__)
        setattr(config, key, value)


def is_vision_language_config(hf_config: Any) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return hf_config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def available_attn_implementation(requested: str) -> str:
    """``requested``, or "sdpa" (with a warning) when flash attention is asked for without a CUDA
    device or without the flash-attn package: the same config then runs on a CPU for testing."""
    if not requested.startswith("flash_attention"):
        return requested
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    installed = is_flash_attn_3_available() if requested == "flash_attention_3" else is_flash_attn_2_available()
    if torch.cuda.is_available() and installed:
        return requested
    reason = "no CUDA device" if not torch.cuda.is_available() else "the flash-attn package is not installed"
    logger.warning("model.attn_implementation=%r but %s; using 'sdpa'", requested, reason)
    return "sdpa"


def attn_implementation_for(hf_config: Any, requested: str, padding_free: bool) -> str | dict[str, str]:
    """What to pass as ``attn_implementation``: the requested one, with the text decoder switched
    to ``VARLEN_ATTENTION`` for padding-free runs (the vision tower keeps the requested one)."""
    if not padding_free:
        return requested
    register_varlen_attention()
    if "text_config" in getattr(hf_config, "sub_configs", {}):
        return {"": requested, "text_config": VARLEN_ATTENTION, "vision_config": requested}
    return VARLEN_ATTENTION


def load_model(
    model_config: Any,
    *,
    role: ModelRole = "policy",
    dtype: torch.dtype = torch.float32,
    padding_free: bool = False,
    trainable: bool = True,
) -> LoadedModel:
    """Load a model on the CPU from ``model_config`` (easyvlm ``ModelConfig``).

    Applies, in order: override_config, attn_implementation (+ varlen attention when
    ``padding_free``), dtype, LoRA (``lora.rank > 0``, policy only), freeze_vision_tower,
    gradient checkpointing (only when ``trainable``). A frozen reference model passes
    ``trainable=False``: all parameters get ``requires_grad=False``.
    """
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    model_dir, _ = resolve_paths(model_config)
    trust_remote_code = bool(_field(model_config, "trust_remote_code", False))
    hf_config = load_hf_config(model_dir, _field(model_config, "override_config"), trust_remote_code)
    vision_language = is_vision_language_config(hf_config)
    if vision_language and hf_config.model_type not in MROPE_MODEL_TYPES:
        raise NotImplementedError(
            f"{model_dir}: vision-language model_type {hf_config.model_type!r} is not supported; "
            f"supported: {sorted(MROPE_MODEL_TYPES)} and text-only causal LMs"
        )
    requested = available_attn_implementation(_field(model_config, "attn_implementation") or "sdpa")
    kwargs = dict(
        config=hf_config,
        dtype=dtype,
        attn_implementation=attn_implementation_for(hf_config, requested, padding_free),
        trust_remote_code=trust_remote_code,
    )

    if role == "policy":
        auto_cls = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
        model = auto_cls.from_pretrained(model_dir, **kwargs)
    elif role == "critic":
        if hf_config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
            hf_config.num_labels = 1
            model = AutoModelForTokenClassification.from_pretrained(model_dir, **kwargs)
        else:
            backbone = AutoModel.from_pretrained(model_dir, **kwargs)
            model = ValueHeadModel(backbone, _text_hidden_size(hf_config), _field(hf_config, "initializer_range", 0.02))
            model.to(dtype)
    else:
        raise ValueError(f"load_model: role must be 'policy' or 'critic', got {role!r}")

    lora = _field(model_config, "lora")
    if lora is not None and _field(lora, "rank", 0) > 0:
        if role != "policy":
            raise ValueError("model.lora.rank > 0 is supported for the actor only; set critic.model.lora.rank=0")
        model = apply_lora(model, lora)

    if not trainable:
        model.requires_grad_(False)
    elif _field(model_config, "freeze_vision_tower", False):
        tower = get_vision_tower(model)
        if tower is None:
            logger.warning("model.freeze_vision_tower=True but %s has no vision tower; ignored", type(model).__name__)
        else:
            tower.requires_grad_(False)

    if trainable and _field(model_config, "enable_gradient_checkpointing", True):
        target = model.backbone if isinstance(model, ValueHeadModel) else model
        # non-reentrant: works with frozen inputs (no enable_input_require_grads hack) and FSDP2
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return LoadedModel(model=model, hf_config=hf_config, is_vision_language=vision_language)


def _text_hidden_size(hf_config: Any) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return text.hidden_size


def get_vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a Qwen2-VL / Qwen2.5-VL model (``.visual``), or None for text-only models.

    Looks through PEFT and :class:`ValueHeadModel` wrappers.
    """
    for name, module in model.named_modules():
        if name.split(".")[-1] == "visual":
            return module
    return None


def apply_lora(model: nn.Module, lora_config: Any) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (``model.lora``: rank, alpha, target_modules, exclude_modules)."""
    from peft import LoraConfig, get_peft_model

    target = _field(lora_config, "target_modules", "all-linear")
    peft_config = LoraConfig(
        r=int(lora_config.rank),
        lora_alpha=int(_field(lora_config, "alpha", 64)),
        target_modules=target if isinstance(target, str) else list(target),
        exclude_modules=_field(lora_config, "exclude_modules"),
        bias="none",
    )
    return get_peft_model(model, peft_config)


def load_tokenizer_and_processor(model_config: Any) -> tuple[Any, Any | None]:
    """(tokenizer, processor or None) from ``tokenizer_path`` (defaults to ``model_path``)."""
    from transformers import AutoProcessor, AutoTokenizer

    _, tokenizer_dir = resolve_paths(model_config)
    trust_remote_code = bool(_field(model_config, "trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    try:
        processor = AutoProcessor.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):  # text-only checkpoints have no processor config
        processor = None
    if processor is not None and getattr(processor, "image_processor", None) is None:
        processor = None  # AutoProcessor falls back to the tokenizer for text-only models
    return tokenizer, processor


class ValueHeadModel(nn.Module):
    """A backbone returning ``last_hidden_state`` (B, L, H) plus ``score``: Linear(H, 1).

    ``forward(**inputs)`` returns an object with ``logits`` (B, L, 1), like
    ``AutoModelForTokenClassification(num_labels=1)``, so the critic handles both the same way.
    The head starts from N(0, initializer_range) weights and a zero bias (transformers' init).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, initializer_range: float = 0.02):
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.score.weight, std=initializer_range)
        nn.init.zeros_(self.score.bias)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, **inputs: Any) -> Any:
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.backbone(**inputs).last_hidden_state  # (B, L, H)
        # clone: Linear on (B, L, H) returns a view, which FSDP2 warns about at the root output
        return TokenClassifierOutput(logits=self.score(hidden).clone())  # (B, L, 1)
