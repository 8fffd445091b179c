"""Running normalisation of reward-model scores (easyvlm.rewards.model_scores), by hand."""

import math

import pytest
import torch

from easyvlm.data.batch import Batch
from easyvlm.rewards.model_scores import RewardModelScores, RunningMoments


def test_running_moments_equal_the_moments_of_everything_seen():
    moments = RunningMoments()
    moments.update([1.0, 3.0])  # mean 2, m2 2
    moments.update([5.0])       # all: 1, 3, 5 -> mean 3, population variance 8 / 3
    assert moments.count == 3 and moments.mean == pytest.approx(3.0)
    assert moments.std == pytest.approx(math.sqrt(8 / 3))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.count, restored.mean, restored.std) == (3, moments.mean, moments.std)


def test_training_scores_update_the_statistics_validation_reads_them():
    scorer = RewardModelScores(lambda batch: Batch({"rm_scores": torch.tensor([1.0, 3.0])}), "running")
    scores, raw, metrics = scorer.score(Batch({"x": torch.zeros(2)}), training=True)
    # mean 2, std 1: (1 - 2) / 1, (3 - 2) / 1
    assert scores == [-1.0, 1.0] and raw == [1.0, 3.0]
    assert metrics["reward_model/running_mean"] == 2.0 and metrics["reward_model/raw_score_std"] == 1.0
    scorer.dispatch = lambda batch: Batch({"rm_scores": torch.tensor([4.0, 4.0])})
    scores, _, _ = scorer.score(Batch({"x": torch.zeros(2)}), training=False)
    assert scores == [2.0, 2.0] and scorer.moments.count == 2  # (4 - 2) / 1, statistics unchanged


def test_without_normalisation_the_raw_score_passes():
    scorer = RewardModelScores(lambda batch: Batch({"rm_scores": torch.tensor([1.5, -2.0])}), "none")
    scores, raw, metrics = scorer.score(Batch({"x": torch.zeros(2)}), training=True)
    assert scores == raw == [1.5, -2.0] and "reward_model/running_mean" not in metrics
