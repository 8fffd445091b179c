"""Weights in a family's checkpoint layout (released checkpoints, vLLM) where it differs from transformers'
in-memory one: Qwen3-VL-MoE's fused experts, stored transposed (``save_pretrained`` does not transpose back).
The builtin model's file, the HF export and the weight sync go through it. docs/rollout.md, "Weight sync"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

from torch import Tensor

# model_type (the top-level config's or the text config's) -> names whose last two dimensions the
# checkpoint holds transposed, as suffixes of the state-dict names
TRANSPOSED_IN_CHECKPOINT: dict[str, tuple[str, ...]] = {
    "qwen3_vl_moe": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
    "qwen3_vl_moe_text": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
}


def transposed_names(hf_config: Any) -> tuple[str, ...]:
    """The state-dict name suffixes ``hf_config``'s checkpoints hold transposed (usually none)."""
    return TRANSPOSED_IN_CHECKPOINT.get(getattr(hf_config, "model_type", ""), ())


def to_checkpoint_layout(hf_config: Any, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs in transformers' in-memory layout -> the same names in ``hf_config``'s checkpoint
    layout, lazily; a transposed tensor is a view (``.contiguous()`` it before writing). Raises ValueError for a
    fused expert tensor not in the in-memory shape (a second transpose would go unnoticed where shapes are equal)."""
    suffixes = transposed_names(hf_config)
    if not suffixes:
        yield from named_tensors
        return
    expected = _in_memory_shapes(hf_config)
    for name, tensor in named_tensors:
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is not None:
            if tuple(tensor.shape) != expected[suffix]:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} is not transformers' in-memory layout "
                    f"{expected[suffix]} of this config; is it in checkpoint layout already?"
                )
            tensor = tensor.transpose(-1, -2)
        yield name, tensor


def rewrite_in_checkpoint_layout(hf_config: Any, directory: str | Path) -> None:
    """Rewrite ``directory``'s ``*.safetensors`` from ``save_pretrained``'s in-memory layout to the checkpoint one, once."""
    if not transposed_names(hf_config):
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}
        rewritten = {name: t.contiguous() for name, t in to_checkpoint_layout(hf_config, state.items())}
        save_file(rewritten, str(path), metadata={**metadata, "format": metadata.get("format", "pt")})


def _in_memory_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts, hidden, width = text.num_experts, text.hidden_size, text.moe_intermediate_size
    return {
        ".mlp.experts.gate_up_proj": (experts, 2 * width, hidden),
        ".mlp.experts.down_proj": (experts, hidden, width),
    }
