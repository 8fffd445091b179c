"""Bradley-Terry loss: hand-derived values and gradients (easyvlm.algorithms.preference)."""

import math

import pytest
import torch
from torch.testing import assert_close

from easyvlm.algorithms.preference import bradley_terry_loss

# pairs r_c = (2, 0, 1), r_r = (0, 0, 3): d = r_c - r_r = (2, 0, -2)
# l = log(1 + e^-d) = (log(1 + e^-2), log 2, log(1 + e^2)) = (0.126928, 0.693147, 2.126928)
CHOSEN, REJECTED = [2.0, 0.0, 1.0], [0.0, 0.0, 3.0]
LOSSES = [0.1269280110429725, 0.6931471805599453, 2.1269280110429727]
# dl/dr_c = -sigmoid(-d) = -(0.119203, 0.5, 0.880797); dl/dr_r = +sigmoid(-d)
SIGMOID_MINUS_D = [0.11920292202211755, 0.5, 0.8807970779778823]


def test_hand_values_and_gradient():
    chosen = torch.tensor(CHOSEN, requires_grad=True)
    rejected = torch.tensor(REJECTED, requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(sum(LOSSES) / 3, rel=1e-6)
    loss.backward()
    assert_close(chosen.grad, -torch.tensor(SIGMOID_MINUS_D) / 3)
    assert_close(rejected.grad, torch.tensor(SIGMOID_MINUS_D) / 3)
    # correct: only d = 2 (the tie d = 0 counts as wrong); margin sum 2 + 0 - 2 = 0
    assert metrics == {"correct": 1.0, "margin": 0.0}


def test_margin_and_normalizer():
    # margin (1, 0, 0): the first pair's d becomes 1, l = log(1 + e^-1) = 0.313262; normalizer 6
    chosen = torch.tensor(CHOSEN, requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, torch.tensor(REJECTED), torch.tensor([1.0, 0.0, 0.0]), normalizer=6)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + LOSSES[1] + LOSSES[2]) / 6, rel=1e-6)
    loss.backward()
    # the first pair's gradient is -sigmoid(-1) / 6 = -0.268941 / 6
    assert_close(chosen.grad, -torch.tensor([0.2689414213699951, 0.5, 0.8807970779778823]) / 6)
    assert metrics["margin"] == 0.0  # the reported margin is r_c - r_r, before the required margin


def test_stable_for_large_differences():
    # -log sigmoid(-200) = 200 exactly in float32 (a naive log(sigmoid) gives inf)
    loss, _ = bradley_terry_loss(torch.tensor([0.0]), torch.tensor([200.0]))
    assert loss.item() == 200.0


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"must both be \(N,\)"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
