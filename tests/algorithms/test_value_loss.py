"""Clipped value loss: hand-derived values, gradient and metrics at B = 3."""

import pytest
import torch
from algorithms_testing import lengths_to_mask
from torch.testing import assert_close

from easyvlm.algorithms import value_loss

NAN = float("nan")
MASK = lengths_to_mask([2, 1, 1], 2)
# cliprange 0.5; v_clip = old + clip(v - old, -0.5, 0.5)
# row 0 t0: v 1, old 0.75 -> v_clip 1; (1 - 1.5)^2 = 0.25 both -> 0.125
# row 0 t1: v 2, old 1 -> v_clip 1.5; (2 - 1)^2 = 1 vs (1.5 - 1)^2 = 0.25 -> 0.5 (unclipped is larger)
# row 1 t0: v 0, old 1 -> v_clip 0.5; (0 - 1.2)^2 = 1.44 vs 0.49 -> 0.72
# row 2 t0: v 2, old 1 -> v_clip 1.5; (2 - 3)^2 = 1 vs (1.5 - 3)^2 = 2.25 -> 1.125 (clipped is larger)
VALUES = [[1.0, 2.0], [0.0, NAN], [2.0, NAN]]
OLD_VALUES = torch.tensor([[0.75, 1.0], [1.0, NAN], [1.0, NAN]])
RETURNS = torch.tensor([[1.5, 1.0], [1.2, NAN], [3.0, NAN]])


def test_hand_values_gradient_and_metrics():
    values = torch.tensor(VALUES).requires_grad_()
    loss, metrics = value_loss(values, OLD_VALUES, RETURNS, MASK, cliprange_value=0.5)
    assert_close(loss, torch.tensor((0.125 + 0.5 + 0.72 + 1.125) / 4))
    # gradient / 4 tokens: t0 v - R = -0.5; t1 (unclipped) 1; row 1 (unclipped) -1.2; row 2 (clipped) 0
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, torch.tensor([[-0.5, 1.0], [-1.2, 0.0], [0.0, 0.0]]) / 4)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 4)
    assert metrics["vpred_mean"] == pytest.approx((1 + 2 + 0 + 2) / 4)


def test_seq_mode():
    # row means (0.125 + 0.5) / 2 = 0.3125, 0.72, 1.125 -> mean 2.1575 / 3
    loss, _ = value_loss(torch.tensor(VALUES), OLD_VALUES, RETURNS, MASK, 0.5, loss_avg_mode="seq")
    assert_close(loss, torch.tensor(2.1575 / 3))


def test_negative_cliprange_is_rejected():
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        value_loss(torch.tensor(VALUES), OLD_VALUES, RETURNS, MASK, -0.1)
