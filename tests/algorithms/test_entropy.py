"""entropy_from_logits against hand values and torch.distributions.Categorical; the bonus term."""

import math

import pytest
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


# ------------------------------------------------------------------ adaptive entropy control
def test_adaptive_controller_steps_gates_and_clamps_by_hand():
    from easyvlm.algorithms.entropy import AdaptiveEntropyController

    ctrl = AdaptiveEntropyController(init_coeff=0.1, target=0.2, delta=0.1, coeff_min=0.0, coeff_max=0.25)
    # before any measurement the bonus is off (TRL: _last_world_entropy = inf, inf <= target is false)
    assert (ctrl.value, ctrl.bonus_coeff) == (0.1, 0.0)
    # H <= 0.2: c + 0.1, at most 0.25; H > 0.2: c - 0.1, at least 0; the bonus is c after H <= 0.2, else 0
    #   H     c                              bonus
    #   0.1   0.1 + 0.1 = 0.2                0.2
    #   0.15  min(0.2 + 0.1, 0.25) = 0.25    0.25   (clamped at the top)
    #   0.2   min(0.35, 0.25) = 0.25         0.25   (H == target counts as below)
    #   0.5   0.25 - 0.1 = 0.15              0      (gated off)
    #   0.3   0.15 - 0.1 = 0.05              0
    #   0.9   max(0.05 - 0.1, 0) = 0         0      (clamped at the bottom)
    #   0.1   0 + 0.1 = 0.1                  0.1
    entropies = [0.1, 0.15, 0.2, 0.5, 0.3, 0.9, 0.1]
    values, bonuses = [], []
    for h in entropies:
        ctrl.update(h)
        values.append(ctrl.value)
        bonuses.append(ctrl.bonus_coeff)
    assert values == pytest.approx([0.2, 0.25, 0.25, 0.15, 0.05, 0.0, 0.1], abs=1e-12)
    assert bonuses == pytest.approx([0.2, 0.25, 0.25, 0.0, 0.0, 0.0, 0.1], abs=1e-12)
    assert ctrl.last_entropy == 0.1


def test_adaptive_controller_state_round_trip(tmp_path):
    from easyvlm.algorithms.entropy import AdaptiveEntropyController

    make = lambda: AdaptiveEntropyController(0.05, target=0.3, delta=0.02, coeff_min=0.01, coeff_max=0.5)  # noqa: E731
    fresh = make()
    # the initial state (last entropy inf) survives the trainer checkpoint's weights_only load
    torch.save(fresh.state_dict(), tmp_path / "fresh.pt")
    restored = make()
    restored.update(0.1)
    restored.load_state_dict(torch.load(tmp_path / "fresh.pt", weights_only=True))
    assert restored.state_dict() == {"value": 0.05, "last_entropy": float("inf")} and restored.bonus_coeff == 0.0
    ctrl = make()
    for h in (0.1, 0.2, 0.9):  # 0.05 -> 0.07 -> 0.09 -> 0.07, last entropy 0.9
        ctrl.update(h)
    torch.save(ctrl.state_dict(), tmp_path / "ctrl.pt")
    restored = make()
    restored.load_state_dict(torch.load(tmp_path / "ctrl.pt", weights_only=True))
    assert restored.state_dict() == ctrl.state_dict() == {"value": pytest.approx(0.07), "last_entropy": 0.9}
    for h in (0.25, 0.4):  # both continue alike
        ctrl.update(h)
        restored.update(h)
        assert (restored.value, restored.bonus_coeff) == (ctrl.value, ctrl.bonus_coeff)


@pytest.mark.parametrize(("init", "target", "delta", "low", "high"), [
    (0.5, 0.2, 0.005, 0.6, 1.0),  # init below min
    (0.1, 0.2, 0.005, 0.3, 0.2),  # min > max
    (0.1, 0.2, 0.0, 0.0, 1.0),  # delta 0
    (0.1, -0.1, 0.005, 0.0, 1.0),  # negative target
])
def test_adaptive_controller_refuses_meaningless_settings(init, target, delta, low, high):
    from easyvlm.algorithms.entropy import AdaptiveEntropyController

    with pytest.raises(ValueError, match="adaptive entropy"):
        AdaptiveEntropyController(init, target, delta, low, high)
