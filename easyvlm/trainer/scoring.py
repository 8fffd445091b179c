"""A training step's rewards over its generation rounds: the kept rows of a round's result, the
rounds' results joined, and the step's result waited for (the scorer itself: easyvlm.pipeline.scoring)."""

from __future__ import annotations

from typing import Any

import ray

from easyvlm.rewards.types import RewardResult
from easyvlm.trainer.metrics import reward_metrics


def select_result(result: RewardResult, rows: list[int]) -> RewardResult:
    return RewardResult({k: [v[i] for i in rows] for k, v in result.scores.items()}, {}, [], list(result.function_keys))


def concat_results(results: list[RewardResult]) -> RewardResult:
    """One result of several rounds' (or of one round's kept rows): scores in order, metrics
    recomputed over them (the error count summed)."""
    scores: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.scores.items():
            scores.setdefault(k, []).extend(v)
    metrics = reward_metrics(scores)
    if any("reward/error_count" in r.metrics for r in results):
        metrics["reward/error_count"] = sum(r.metrics.get("reward/error_count", 0.0) for r in results)
    function_keys = list(results[0].function_keys) if results else []  # the same reward functions every round
    return RewardResult(scores, metrics, [e for r in results for e in r.errors], function_keys)


def collect(reward: Any) -> RewardResult:
    """The step's rewards: already a result (online filtering waited for it), or the rounds' refs."""
    return reward if isinstance(reward, RewardResult) else concat_results(ray.get(reward))
