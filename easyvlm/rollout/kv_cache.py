"""The CPU engine's explicit KV-cache size, sized to the work; no vllm import (the config check uses
it). docs/rollout.md, "vLLM on the CPU"."""

from __future__ import annotations

import math
from typing import Any

# The CPU engine's KV block size, passed to vLLM explicitly so that this sizing and the engine's block
# count agree: the smallest its CPU attention kernels take, not its default of 128, because vLLM shares
# a prompt's KV only in whole blocks: a GRPO group's n copies of a prompt then prefill it about once
# (docs/benchmarks.md, "Prompts prefilled once per group on the CPU").
KV_BLOCK_TOKENS = 32


def kv_bytes_per_token(model_config: Any, dtype_bytes: int = 4) -> int:
    """K and V of one token over all layers: 2 x layers x KV heads x head dim x ``dtype_bytes``."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def kv_blocks(max_model_len: int, max_num_seqs: int, sequence_tokens: int | None = None) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``sequence_tokens`` tokens (None or more: ``max_model_len``),
    at least one sequence of ``max_model_len`` (vLLM's minimum), plus the null block."""
    longest = min(sequence_tokens or max_model_len, max_model_len)
    per_sequence = math.ceil(longest / KV_BLOCK_TOKENS)
    return max(max_num_seqs * per_sequence, math.ceil(max_model_len / KV_BLOCK_TOKENS)) + 1


def min_cpu_kv_cache_bytes(model_config: Any, max_model_len: int, dtype_bytes: int = 4) -> int:
    """The smallest cache vLLM starts with: one sequence of ``max_model_len`` tokens plus the null block."""
    return kv_blocks(max_model_len, 1) * KV_BLOCK_TOKENS * kv_bytes_per_token(model_config, dtype_bytes)


def cpu_kv_cache_bytes(
    model_config: Any,
    max_model_len: int,
    max_num_seqs: int,
    memory_fraction: float,
    available_bytes: int,
    sequence_tokens: int | None = None,
    dtype_bytes: int = 4,
) -> int:
    """``kv_blocks`` blocks' bytes, capped at ``memory_fraction`` of ``available_bytes``. Raises ValueError
    when one sequence of ``max_model_len`` does not fit."""
    per_block = KV_BLOCK_TOKENS * kv_bytes_per_token(model_config, dtype_bytes)
    cap = int(memory_fraction * available_bytes)
    smallest = min_cpu_kv_cache_bytes(model_config, max_model_len, dtype_bytes)
    if cap < smallest:
        raise ValueError(
            f"the CPU KV cache for one sequence of max_model_len={max_model_len} tokens needs "
            f"{smallest / 2**20:.0f} MiB, but worker.rollout.gpu_memory_utilization={memory_fraction} of the "
            f"{available_bytes / 2**30:.1f} GiB free memory is only {cap / 2**20:.0f} MiB; raise "
            f"gpu_memory_utilization or lower data.max_prompt_length / data.max_response_length"
        )
    return min(kv_blocks(max_model_len, max_num_seqs, sequence_tokens) * per_block, cap)
