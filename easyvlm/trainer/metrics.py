"""Step metrics under EasyR1's names and meanings (``verl/trainer/metrics.py``), pure functions."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    """<prefix>/{mean,max,min}; NaN for no values (a batch whose responses are all empty)."""
    values = values.float()
    if values.numel() == 0:
        return {f"{prefix}/{name}": float("nan") for name in ("mean", "max", "min")}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def response_metrics(
    response_mask: Tensor, prompt_mask: Tensor | None, max_response_length: int, max_prompt_length: int | None = None
) -> dict[str, float]:
    """response_length/{mean,max,min,clip_ratio} and prompt_length/* from bool masks (B, T), (B, P) or
    None. clip_ratio: the share of lengths at the limit (EasyR1's); the prompt's with ``max_prompt_length``."""
    lengths = response_mask.sum(-1)
    metrics = _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    if prompt_mask is not None:
        prompt_lengths = prompt_mask.sum(-1)
        metrics.update(_stats("prompt_length", prompt_lengths))
        if max_prompt_length is not None:
            metrics["prompt_length/clip_ratio"] = (prompt_lengths >= max_prompt_length).float().mean().item()
    return metrics


def data_metrics(
    seq_scores: Tensor,
    token_rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
) -> dict[str, float]:
    """EasyR1's ``critic/*`` data metrics of one training batch: (B, T) tensors (or None) over the valid
    tokens of ``response_mask``, ``critic/rewards/*`` over per-sequence sums; with values,
    ``critic/vf_explained_var`` = 1 - Var(returns - values) / (Var(returns) + 1e-5)."""
    check_mask(response_mask, token_rewards)
    metrics = _stats("critic/score", seq_scores)
    # where, not a product: NaN stored at a padding position must not reach a sum
    metrics.update(_stats("critic/rewards", torch.where(response_mask, token_rewards, 0.0).sum(-1)))
    metrics.update(_stats("critic/advantages", advantages[response_mask]))
    valid_returns = returns[response_mask].float()
    metrics.update(_stats("critic/returns", valid_returns))
    if values is not None:
        valid_values = values[response_mask].float()
        metrics.update(_stats("critic/values", valid_values))
        explained = 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()
    return metrics


# EasyR1's token counts per timed section: generation and reward scale with the response tokens,
# the forward/backward passes (and the advantage math) with every token, prompt included
RESPONSE_TOKEN_SECTIONS = ("gen", "reward")
TOTAL_TOKEN_SECTIONS = ("old", "ref", "teacher", "values", "adv", "update_critic", "update_actor")


def timing_per_token_metrics(timings: Mapping[str, float], num_response_tokens: int, num_total_tokens: int) -> dict[str, float]:
    """``timing_per_token_ms/<section>`` = 1000 * ``timings["timing_s/<section>"]`` / its tokens
    (response tokens for generation and reward, all for the passes); EasyR1's timers that ran only."""
    tokens = {**dict.fromkeys(RESPONSE_TOKEN_SECTIONS, num_response_tokens), **dict.fromkeys(TOTAL_TOKEN_SECTIONS, num_total_tokens)}
    return {
        f"timing_per_token_ms/{name}": 1000.0 * timings[f"timing_s/{name}"] / count
        for name, count in tokens.items()
        if f"timing_s/{name}" in timings and count > 0
    }


def throughput_metrics(num_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """perf/total_num_tokens (prompt + response, unpadded), perf/time_per_step (s) and
    perf/throughput: tokens per second per device."""
    return {
        "perf/total_num_tokens": float(num_tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": num_tokens / max(step_seconds, 1e-9) / world_size,
    }
