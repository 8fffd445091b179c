"""The reward model's scores in the driver, optionally standardised (``normalize=running``: (s - mean)
/ std over every training score so far, this step's included). docs/rewards.md, "Model-based
rewards: a trained reward model"."""

from __future__ import annotations

import math
from typing import Callable

from easyvlm.data.batch import Batch

STD_FLOOR = 1e-6  # a constant score has std 0: divide by this instead


class RunningMoments:
    """Count, mean and variance of every value seen (Chan's parallel update: exact, batch by batch)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n = len(values)
        batch_mean = sum(values) / n
        batch_m2 = sum((v - batch_mean) ** 2 for v in values)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": float(self.count), "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


class RewardModelScores:
    """Scores a rollout Batch with the reward model worker group (``dispatch``: the group's
    ``compute_scores`` on the batch's model inputs)."""

    def __init__(self, dispatch: Callable[[Batch], Batch], normalize: str):
        assert normalize in ("none", "running"), normalize
        self.dispatch = dispatch
        self.normalize = normalize
        self.moments = RunningMoments()

    def score(self, batch: Batch, training: bool) -> tuple[list[float], list[float], dict[str, float]]:
        """(scores the reward functions get, raw scores, metrics); ``training`` updates the statistics first."""
        raw = self.dispatch(batch)["rm_scores"].float()
        values = raw.tolist()
        if self.normalize == "running" and training:
            self.moments.update(values)
        scores = values
        if self.normalize == "running":
            scores = ((raw - self.moments.mean) / max(self.moments.std, STD_FLOOR)).tolist()
        metrics = {
            "reward_model/raw_score_mean": float(raw.mean()),
            "reward_model/raw_score_std": float(raw.std(unbiased=False)),
            "reward_model/raw_score_max": float(raw.max()),
            "reward_model/raw_score_min": float(raw.min()),
        }
        if self.normalize == "running":
            metrics.update({"reward_model/running_mean": self.moments.mean, "reward_model/running_std": self.moments.std})
        return scores, values, metrics

    def state_dict(self) -> dict[str, float]:
        return self.moments.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.moments.load_state_dict(state)
