"""Rollout-training mismatch metrics, by hand (easyvlm.algorithms.rollout_mismatch)."""

import math

import pytest
import torch

from easyvlm.algorithms.rollout_mismatch import rollout_mismatch


def test_hand_values():
    # log r = train - rollout on the 3 valid tokens: ln 3, -ln 2, 0 (the 4th token is padding)
    train = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]])
    rollout = torch.tensor([[-1.0 - math.log(3), -2.0 + math.log(2)], [-0.5, -9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = rollout_mismatch(train, rollout, mask)
    # k1 = mean(-log r) = (-ln 3 + ln 2 + 0) / 3
    assert out["k1"] == pytest.approx((-math.log(3) + math.log(2)) / 3, rel=1e-6)
    # k3 = mean(r - 1 - log r) = ((3 - 1 - ln 3) + (0.5 - 1 + ln 2) + 0) / 3
    assert out["k3"] == pytest.approx(((2 - math.log(3)) + (-0.5 + math.log(2))) / 3, rel=1e-6)
    assert out["ratio_mean"] == pytest.approx((3 + 0.5 + 1) / 3, rel=1e-6)
    # r = 3 is outside [1/2, 2]; r = 1/2 is on the edge (inside); the padding's r = e^16 is not counted
    assert out["ratio_outside"] == pytest.approx(1 / 3)


def test_no_mismatch_is_all_zero():
    logprobs = torch.tensor([[-0.3, -1.2, -4.0]])
    out = rollout_mismatch(logprobs, logprobs.clone(), torch.ones(1, 3, dtype=torch.bool))
    assert out == {"k1": 0.0, "k3": 0.0, "ratio_mean": 1.0, "ratio_outside": 0.0}
