"""Step metrics: timers and the data metrics EasyR1 users look for (reward/*, response_length/*).

Pure bookkeeping over tensors; no model, no config.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import Tensor


@contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timings["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def mean_metrics(metric_dicts: list[Mapping[str, float]]) -> dict[str, float]:
    """Average each key over the dicts that have it (micro-batch / rank metrics -> one value)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for metrics in metric_dicts:
        for key, value in metrics.items():
            sums[key] += float(value)
            counts[key] += 1
    return {key: sums[key] / counts[key] for key in sums}


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def response_metrics(response_mask: Tensor, prompt_mask: Tensor | None, max_response_length: int) -> dict[str, float]:
    """response_length/{mean,max,min,clip_ratio} and prompt_length/*.

    response_mask: (B, T) bool. prompt_mask: (B, P) bool or None. clip_ratio is the share of responses
    that hit ``max_response_length`` (truncated, no EOS inside the budget).
    """
    lengths = response_mask.sum(-1)
    metrics = _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    if prompt_mask is not None:
        metrics.update(_stats("prompt_length", prompt_mask.sum(-1)))
    return metrics


def reward_metrics(scores: Mapping[str, list[float]], prefix: str = "reward") -> dict[str, float]:
    """reward/<key> = mean of each score key over the batch (``overall`` included)."""
    return {f"{prefix}/{key}": float(torch.tensor(values, dtype=torch.float64).mean()) for key, values in scores.items() if values}


def val_metrics(scores: Mapping[str, list[float]]) -> dict[str, float]:
    """EasyR1's validation names: val/reward_score (overall) and val/<key>_reward for sub-scores."""
    out = {}
    for key, values in scores.items():
        mean = float(torch.tensor(values, dtype=torch.float64).mean())
        out["val/reward_score" if key == "overall" else f"val/{key}_reward"] = mean
    return out


def throughput_metrics(num_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """perf/throughput: tokens (prompt + response, unpadded) per second per device."""
    return {"perf/total_num_tokens": float(num_tokens), "perf/throughput": num_tokens / max(step_seconds, 1e-9) / world_size}
