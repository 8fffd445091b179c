"""Weights in a family's checkpoint layout: what the real checkpoints (and so vLLM) hold, where it
differs from the layout transformers keeps in memory.

Qwen3-VL-MoE is the one family here where the two differ. transformers 5.19 holds each decoder
layer's fused experts as ``mlp.experts.gate_up_proj`` (E, 2*I, hidden) and ``mlp.experts.down_proj``
(E, hidden, I), i.e. as ``nn.Linear`` weights; the released checkpoints store them transposed,
(E, hidden, 2*I) and (E, I, hidden). transformers' loader transposes on load only when a tensor's
shape differs from the parameter's (``conversion_mapping.py`` "qwen3_vl_moe",
``Transpose(check_dims=True)``), and ``save_pretrained`` applies the same rule in reverse, so it
writes the in-memory layout unchanged. vLLM's loader (``models/qwen3_vl_moe.py``,
``is_fused_checkpoint_transposed=True``) always transposes these two names, from a file and from
``reload_weights`` alike: given the in-memory layout it loads garbage or fails on the shapes.

So whatever leaves transformers for a Qwen3-VL-MoE consumer goes through :func:`to_checkpoint_layout`:
the builtin model's file, the actor's HF export (:func:`rewrite_in_checkpoint_layout` on the
directory ``save_pretrained`` wrote) and vLLM's weight sync (the tensors as they stream). Both
transformers and vLLM load the result. Every other family passes through unchanged (Qwen3.5-MoE's
``save_pretrained`` already writes per-expert tensors, which vLLM loads).
"""

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
    """The suffixes of the state-dict names that ``hf_config``'s checkpoints hold transposed (none
    for most families)."""
    return TRANSPOSED_IN_CHECKPOINT.get(getattr(hf_config, "model_type", ""), ())


def to_checkpoint_layout(hf_config: Any, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs in transformers' in-memory layout -> the same names in the
    checkpoint layout of ``hf_config``'s family, lazily (one pair at a time, as the weight sync
    streams them). A transposed tensor is a view (no copy); ``.contiguous()`` it before writing.

    Raises ValueError for a fused expert tensor whose shape is not the in-memory one of
    ``hf_config`` (already in checkpoint layout, or another model's): transposing it again would
    go unnoticed wherever the two shapes are equal.
    """
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
    """Rewrite the ``*.safetensors`` files that ``save_pretrained`` wrote into ``directory`` in the
    checkpoint layout of ``hf_config``'s family (nothing to do for most families). Each file keeps
    its names, so an index file stays valid. Call it once, on files in the in-memory layout."""
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
    """Suffix -> the shape transformers gives that fused expert tensor (Qwen3-VL-MoE)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts, hidden, width = text.num_experts, text.hidden_size, text.moe_intermediate_size
    return {
        ".mlp.experts.gate_up_proj": (experts, 2 * width, hidden),
        ".mlp.experts.down_proj": (experts, hidden, width),
    }
