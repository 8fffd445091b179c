"""Scoring rollouts in the driver: the reward model's scores and the judge's verdicts join the reward
functions' inputs, and the reward actor (easyvlm.rewards.actor) scores them asynchronously."""

from __future__ import annotations

import time
from typing import Any

import ray

from easyvlm.data.batch import Batch
from easyvlm.rewards.actor import build_reward_inputs
from easyvlm.rewards.judge import Judge
from easyvlm.rewards.model_scores import RewardModelScores
from easyvlm.rewards.types import RewardResult
from easyvlm.trainer.metrics import reward_metrics


class Scorer:
    """Turns a rollout batch into the reward functions' inputs and hands them to the reward actor.

    ``step_metrics`` gathers the reward model's and the judge's metrics of the step's own samples
    (``training=True``) until the step takes them."""

    def __init__(self, reward_actor: Any, tokenizer: Any, skip_special_tokens: bool,
                 reward_model_scores: RewardModelScores | None = None, judge: Judge | None = None):
        self.reward_actor = reward_actor
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.reward_model_scores = reward_model_scores
        self.judge = judge
        self.step_metrics: dict[str, float] = {}

    def inputs(self, batch: Batch, training: bool = False) -> list:
        """The reward functions' inputs; with ``worker.reward_model``, its scores first (``training``:
        the step's own samples, which update the running statistics and are logged)."""
        scores = None
        if self.reward_model_scores is not None:
            start = time.perf_counter()
            scores, raw, rm_metrics = self.reward_model_scores.score(batch, training)
            if training:
                self.step_metrics.update(rm_metrics)  # several generation rounds: the last round's
                self.step_metrics["timing_s/reward_model"] = (
                    self.step_metrics.get("timing_s/reward_model", 0.0) + time.perf_counter() - start)
            scores = (scores, raw)
        inputs = build_reward_inputs(batch, self.tokenizer, self.skip_special_tokens, scores)
        if self.judge is not None:
            verdicts, judge_metrics = self.judge.score(inputs)
            for item, value in zip(inputs, verdicts):
                item.judge_score = value
            if training:
                for key, value in judge_metrics.items():  # several generation rounds: added up
                    self.step_metrics[key] = self.step_metrics.get(key, 0.0) + value
        return inputs

    def submit(self, inputs: list) -> Any:
        """A Ray ref of the reward actor's `RewardResult` for ``inputs``."""
        return self.reward_actor.compute.remote(inputs)

    def score(self, batch: Batch) -> RewardResult:
        """``batch``'s rewards, waited for (validation, baselines: nothing to overlap with)."""
        return ray.get(self.submit(self.inputs(batch)))

    def take_step_metrics(self) -> dict[str, float]:
        metrics, self.step_metrics = self.step_metrics, {}
        return metrics


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
