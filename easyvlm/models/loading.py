"""Load the policy / reference / critic models of a ``ModelSpec``, the tokenizer and processor. The critic is
``AutoModelForTokenClassification(num_labels=1)``, else :class:`ValueHeadModel`. docs/workers.md, "Models"."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from easyvlm.models.linear_attention import has_linear_attention, segment_linear_attention
from easyvlm.models.moe_routing import install_replay_routers, is_moe_config
from easyvlm.models.padding_free import VARLEN_ATTENTION, register_varlen_attention
from easyvlm.models.paths import local_model_dir
from easyvlm.models.position_ids import MROPE_MODEL_TYPES
from easyvlm.models.reward_model import ScalarHeadModel, register_sequence_classification
from easyvlm.models.vision_attention import batch_vision_windows
from easyvlm.models.specs import LoraSpec, ModelSpec

logger = logging.getLogger(__name__)

ModelRole = Literal["policy", "critic", "reward"]


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model` returns. ``hf_config`` is the (overridden) transformers config;
    ``is_vision_language``: the model takes pixel_values / image_grid_thw."""

    model: nn.Module
    hf_config: Any
    is_vision_language: bool


def load_hf_config(model_dir: str, override_config: dict | None = None, trust_remote_code: bool = False) -> Any:
    """transformers config of ``model_dir`` with ``override_config`` applied (nested dicts for sub-configs)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    apply_config_overrides(config, override_config or {})
    return config


class UnknownOverrideError(ValueError):
    """An ``override_config`` key the model's config does not have (``.key``: its dotted path)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def apply_config_overrides(hf_config: Any, overrides: dict, where: str = "model.override_config") -> None:
    """Set ``overrides`` on ``hf_config`` in place (nested dicts recurse into sub-configs). Raises
    `UnknownOverrideError` for a key it lacks: transformers configs would silently accept it."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_config_overrides(current, value, f"{where}.{key}")
            continue
        if not hasattr(hf_config, key):
            known = sorted(k for k in hf_config.to_dict() if not k.startswith("_"))
            raise UnknownOverrideError(
                f"{where}.{key}", f"is not an attribute of {type(hf_config).__name__}, so the model would ignore it; "
                f"check the spelling (its keys: {', '.join(known[:40])}{' ...' if len(known) > 40 else ''})",
            )
        setattr(hf_config, key, value)


def is_vision_language_config(hf_config: Any) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return hf_config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def available_attn_implementation(requested: str) -> str:
    """``requested``, or "sdpa" (with a warning) when flash attention is asked for without CUDA or
    flash-attn, so the same config runs on a CPU."""
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
    spec: ModelSpec,
    *,
    role: ModelRole = "policy",
    dtype: torch.dtype = torch.float32,
    padding_free: bool = False,
    trainable: bool = True,
    on_meta: bool = False,
) -> LoadedModel:
    """Build the model of ``spec`` on the CPU, or with ``on_meta`` on the meta device without reading weights
    (FSDP rank-0 init), with ``spec``'s attention, experts, dtype, LoRA (policy), frozen tower and checkpointing
    applied and easyvlm's layer swaps; ``trainable=False`` freezes every parameter."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    hf_config = copy.deepcopy(spec.hf_config)  # the spec's config stays as the driver made it
    vision_language = is_vision_language_config(hf_config)
    # the config check (easyvlm.plan.checks.model_problems) refused other families before anything started
    assert not vision_language or hf_config.model_type in MROPE_MODEL_TYPES, hf_config.model_type
    if role not in ("policy", "critic", "reward"):
        raise ValueError(f"load_model: role must be 'policy', 'critic' or 'reward', got {role!r}")
    assert spec.lora is None or role == "policy", "validate() refuses LoRA on the critic and the reward model"
    requested = available_attn_implementation(spec.attn_implementation)
    kwargs = dict(
        dtype=dtype,
        attn_implementation=attn_implementation_for(hf_config, requested, padding_free),
        trust_remote_code=spec.trust_remote_code,
    )
    if is_moe_config(hf_config):  # transformers' grouped products unless the model section says eager
        kwargs["experts_implementation"] = spec.experts_implementation or "grouped_mm"

    def build(auto_cls: Any) -> nn.Module:
        if on_meta:
            with torch.device("meta"):
                return auto_cls.from_config(hf_config, **kwargs)
        return auto_cls.from_pretrained(local_model_dir(spec.model_dir, spec.model_path), config=hf_config, **kwargs)  # this node's files

    if role == "policy":
        model = build(AutoModelForImageTextToText if vision_language else AutoModelForCausalLM)
    elif role == "reward":  # a scalar sequence classifier, scored per token (easyvlm.models.reward_model)
        register_sequence_classification()
        model = ScalarHeadModel(build(AutoModelForSequenceClassification))
    elif hf_config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        hf_config.num_labels = 1
        model = build(AutoModelForTokenClassification)
    else:
        backbone = build(AutoModel)
        with torch.device("meta" if on_meta else "cpu"):
            text = _text_config(hf_config)
            model = ValueHeadModel(backbone, text.hidden_size, text.initializer_range)
        model.to(dtype)

    if vision_language:  # the tower's windows in a few SDPA calls, not one per window (vision_attention.py)
        batch_vision_windows(model)
    if padding_free and has_linear_attention(hf_config):  # exact packed rows for recurrent layers
        segment_linear_attention(model)
    if role == "policy":  # MoE: routers that can record and replay their experts (moe_routing.py)
        install_replay_routers(model)
    if spec.lora is not None:
        model = apply_lora(model, spec.lora)

    _set_trainable(model, spec, trainable)
    return LoadedModel(model=model, hf_config=hf_config, is_vision_language=vision_language)


def _set_trainable(model: nn.Module, spec: ModelSpec, trainable: bool) -> None:
    if not trainable:
        model.requires_grad_(False)
    elif spec.freeze_vision_tower:
        tower = get_vision_tower(model)
        if tower is None:
            logger.warning("model.freeze_vision_tower=True but %s has no vision tower; ignored", type(model).__name__)
        else:
            tower.requires_grad_(False)

    if trainable and spec.gradient_checkpointing:
        target = model.backbone if isinstance(model, ValueHeadModel) else model.model if isinstance(model, ScalarHeadModel) else model
        # non-reentrant: works with frozen inputs (no enable_input_require_grads hack) and FSDP2
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def get_vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder (``.visual``, with Qwen3-VL's DeepStack mergers) through PEFT and value-head wrappers, or None."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "visual":
            return module
    return None


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """PEFT LoRA adapters of rank ``lora.rank``, scale ``lora.alpha / lora.rank``. ``target_modules``:
    ``"all-linear"`` (not the output head), a regular expression of full names, or a tuple of name
    suffixes; ``exclude_modules``: a regular expression of full names."""
    from peft import LoraConfig, get_peft_model

    target = lora.target_modules
    peft_config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=target if isinstance(target, str) else list(target),
        exclude_modules=lora.exclude_modules,
        bias="none",
    )
    return get_peft_model(model, peft_config)


def load_tokenizer_and_processor(tokenizer_dir: str, trust_remote_code: bool) -> tuple[Any, Any | None]:
    """(tokenizer, processor or None) of the local directory ``tokenizer_dir``."""
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    try:
        processor = AutoProcessor.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):  # text-only checkpoints have no processor config
        processor = None
    if processor is not None and getattr(processor, "image_processor", None) is None:
        processor = None  # AutoProcessor falls back to the tokenizer for text-only models
    return tokenizer, processor


class ValueHeadModel(nn.Module):
    """A backbone returning ``last_hidden_state`` (B, L, H) plus ``score``: Linear(H, 1), with
    ``forward(**inputs).logits`` (B, L, 1) as ``AutoModelForTokenClassification(num_labels=1)``."""

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
