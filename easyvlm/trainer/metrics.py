"""Step metrics: timers and the data metrics EasyR1 users look for, under EasyR1's names.

``reward/*``, ``response_length/*``, ``prompt_length/*``, ``critic/{score,rewards,advantages,returns,
values}/*``, ``critic/vf_explained_var``, ``timing_per_token_ms/*``, ``perf/*``; meanings as in
EasyR1's ``verl/trainer/metrics.py``. Pure bookkeeping over tensors; no model, no config.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask


@contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timings["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    """<prefix>/{mean,max,min}; NaN for no values (a batch whose responses are all empty)."""
    values = values.float()
    if values.numel() == 0:
        return {f"{prefix}/{name}": float("nan") for name in ("mean", "max", "min")}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def response_metrics(
    response_mask: Tensor, prompt_mask: Tensor | None, max_response_length: int, max_prompt_length: int | None = None
) -> dict[str, float]:
    """response_length/{mean,max,min,clip_ratio} and prompt_length/{mean,max,min[,clip_ratio]}.

    response_mask: (B, T) bool. prompt_mask: (B, P) bool or None. response_length/clip_ratio is the
    share of responses that hit ``max_response_length`` (truncated, no EOS inside the budget);
    prompt_length/clip_ratio (only when ``max_prompt_length`` is given: P is the batch's longest
    prompt, not data.max_prompt_length) the share of prompts at the limit ``max_prompt_length``
    (EasyR1's meaning: prompts that were cut, or just fit).
    """
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
    """EasyR1's ``critic/*`` data metrics of one training batch.

    seq_scores: (B,) the reward function's ``overall`` score per sequence. token_rewards: (B, T) the
    rewards the advantage estimator saw (after the KL penalty when KL is in the reward).
    advantages, returns: (B, T). response_mask: (B, T) bool. values: (B, T) critic values or None.

    - ``critic/score/*``: over ``seq_scores``; ``critic/rewards/*``: over the per-sequence sums of
      ``token_rewards`` at valid tokens (score minus the summed KL penalty);
    - ``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*``: over valid tokens;
    - ``critic/vf_explained_var`` = 1 - Var(returns - values) / (Var(returns) + 1e-5) over valid
      tokens, unbiased variances (EasyR1's formula; 1 = the critic predicts the returns exactly,
      0 = no better than their mean, < 0 worse). Only with ``values``.
    """
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
    """``timing_per_token_ms/<section>`` = 1000 * ``timings["timing_s/<section>"]`` / its tokens.

    timings: the step's ``timing_s/*`` seconds (from :func:`timed`). num_response_tokens: valid
    response tokens of the batch (``response_mask.sum()``); num_total_tokens: prompt + response
    tokens (``attention_mask.sum()``). Sections that did not run this step (no ``timing_s`` key) and
    sections over zero tokens are left out; timers easyvlm adds (gen_baseline, ...) and validation have no
    per-token value, as in EasyR1.
    """
    tokens = {**dict.fromkeys(RESPONSE_TOKEN_SECTIONS, num_response_tokens), **dict.fromkeys(TOTAL_TOKEN_SECTIONS, num_total_tokens)}
    return {
        f"timing_per_token_ms/{name}": 1000.0 * timings[f"timing_s/{name}"] / count
        for name, count in tokens.items()
        if f"timing_s/{name}" in timings and count > 0
    }


def reward_metrics(scores: Mapping[str, list[float]], prefix: str = "reward") -> dict[str, float]:
    """reward/<key> = mean of each score key over the batch (``overall`` included)."""
    return {f"{prefix}/{key}": float(torch.tensor(values, dtype=torch.float64).mean()) for key, values in scores.items() if values}


def throughput_metrics(num_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """perf/total_num_tokens (prompt + response, unpadded), perf/time_per_step (s) and
    perf/throughput: tokens per second per device."""
    return {
        "perf/total_num_tokens": float(num_tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": num_tokens / max(step_seconds, 1e-9) / world_size,
    }
