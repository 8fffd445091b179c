"""entropy_from_logits against hand values and torch.distributions.Categorical; the bonus term."""

import math

import torch
from algorithms_testing import lengths_to_mask
from torch.testing import assert_close

from easyvlm.algorithms import entropy_bonus_loss, entropy_from_logits

INF = float("inf")


def test_hand_values():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -INF, -INF]],  # uniform over 4: ln 4; over 2 (2 masked): ln 2
            [[5.0, -INF, -INF, -INF], [1000.0, 0.0, 0.0, 0.0]],  # one-hot: 0; huge logit: ~0, no overflow
            [[math.log(2), 0.0, 0.0, -INF], [0.0, 0.0, 0.0, 0.0]],  # p = (1/2, 1/4, 1/4): 1.5 ln 2
        ]
    )
    expected = torch.tensor([[math.log(4), math.log(2)], [0.0, 0.0], [1.5 * math.log(2), math.log(4)]])
    assert_close(entropy_from_logits(logits), expected)


def test_matches_categorical_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 4, 11, generator=gen)).requires_grad_()
    ours = entropy_from_logits(logits)
    theirs = torch.distributions.Categorical(logits=logits).entropy()
    assert_close(ours, theirs)
    weights = torch.randn(3, 4, generator=gen)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), logits)
    assert_close(g_ours, g_theirs)


def test_gradient_is_finite_with_masked_vocabulary():
    logits = torch.tensor([[[0.3, -INF, 1.0]]] * 3, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[..., 1] == 0).all()


def test_bf16_input_gives_float32_output():
    out = entropy_from_logits(torch.zeros(3, 2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert_close(out, torch.full((3, 2), math.log(8)))


def test_entropy_bonus_loss_is_minus_coeff_times_aggregate():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [6.0, 0.0, 0.0]])
    mask = lengths_to_mask([3, 1, 1], 3)
    # token mean (1 + 2 + 3 + 4 + 6) / 5 = 3.2 -> -0.01 * 3.2; seq: (2 + 4 + 6) / 3 = 4 -> -0.04
    assert_close(entropy_bonus_loss(entropy, mask, 0.01, "token"), torch.tensor(-0.032))
    assert_close(entropy_bonus_loss(entropy, mask, 0.01, "seq"), torch.tensor(-0.04))
