"""KL estimators, controllers, KL-in-reward and KL loss: hand-derived values at B = 3."""

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask
from torch.testing import assert_close

from easyvlm.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_names,
    kl_penalty,
)

NAN = float("nan")
# B = 3, T = 2; d = logprobs - ref_logprobs = [[0.5, -1], [0, 2], [-0.25, 1]]
LOGPROBS = torch.tensor([[-1.0, -2.0], [-0.5, -0.1], [-1.25, -3.0]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0], [-0.5, -2.1], [-1.0, -4.0]])


def k3(d: float) -> float:
    """exp(-d) + d - 1 for d = log pi - log pi_ref."""
    return math.exp(-d) + d - 1


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [[0.5, -1.0], [0.0, 2.0], [-0.25, 1.0]]),
        ("abs", [[0.5, 1.0], [0.0, 2.0], [0.25, 1.0]]),
        ("mse", [[0.125, 0.5], [0.0, 2.0], [0.03125, 0.5]]),  # d^2 / 2
        # k3: d = 0.5 -> exp(-0.5) - 0.5 = 0.106531; d = -1 -> e - 2 = 0.718282; d = 2 -> exp(-2) + 1 = 1.135335
        ("low_var_kl", [[k3(0.5), k3(-1.0)], [0.0, k3(2.0)], [k3(-0.25), k3(1.0)]]),
    ],
)
def test_token_estimators_hand_values(kind, expected):
    assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS, kind), torch.tensor(expected))


def test_low_var_kl_is_clamped():
    # d = +30: log-ratio -30 clamped to -20 -> exp(-20) + 19 ~ 19 -> clamped to 10; d = -30 -> clamp 20 -> 10
    out = kl_penalty(torch.tensor([[0.0, -30.0]] * 3), torch.tensor([[-30.0, 0.0]] * 3), "low_var_kl")
    assert_close(out, torch.full((3, 2), 10.0))


def test_full_kl_hand_value_and_zero_probabilities():
    # p = (1/2, 1/4, 1/4), q = (1/4, 1/4, 1/2): KL = 1/2 ln 2 + 0 + 1/4 ln(1/2) = ln(2) / 4 = 0.173287
    # p = (1, 0, 0) (log p = 0, -inf, -inf), q uniform: KL = ln 3; p = q: 0
    p = torch.tensor([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], [[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [[1 / 3] * 3] * 2])
    q = torch.tensor([[[0.25, 0.25, 0.5], [1 / 3] * 3], [[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], [[1 / 3] * 3] * 2])
    out = kl_penalty(p.log(), q.log(), "full")
    assert_close(out, torch.tensor([[math.log(2) / 4, math.log(3)], [0.0, 0.0], [0.0, 0.0]]))


def test_full_kl_gradient_is_finite_at_removed_ids():
    # the rollout's blocked ids are -inf in both distributions. p = (1/2, 1/2, 0), q = (1/4, 3/4, 0) in
    # log space: KL = 1/2 ln 2 + 1/2 ln(2/3); dKL/dlog p_v = p_v (log p_v - log q_v + 1): at the
    # removed id 0 (not NaN, which a where() after the product would give)
    logp = torch.tensor([[[0.5, 0.5, 0.0]]]).log().requires_grad_()
    logq = torch.tensor([[[0.25, 0.75, 0.0]]]).log()
    kl = kl_penalty(logp, logq, "full")
    assert_close(kl, torch.tensor([[0.5 * math.log(2) + 0.5 * math.log(2 / 3)]]))
    kl.sum().backward()
    expected = torch.tensor([[[0.5 * (math.log(2) + 1), 0.5 * (math.log(2 / 3) + 1), 0.0]]])
    assert_close(logp.grad, expected)


def test_full_kl_matches_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(3, 4, 6, generator=gen), torch.randn(3, 4, 6, generator=gen)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=logits), torch.distributions.Categorical(logits=ref_logits)
    )
    assert_close(kl_penalty(logits.log_softmax(-1), ref_logits.log_softmax(-1), "full"), expected)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_k1_and_k3_are_unbiased(kind):
    # E_{v ~ pi}[k(v)] computed exactly (a sum over the vocabulary) equals the full KL, as long as
    # k3's clamp at 10 is not reached (mild logits: |log pi - log pi_ref| stays well below 2.4)
    gen = torch.Generator().manual_seed(1)
    logp = (0.5 * torch.randn(3, 2, 5, generator=gen)).log_softmax(-1)
    ref = (0.5 * torch.randn(3, 2, 5, generator=gen)).log_softmax(-1)
    expectation = (logp.exp() * kl_penalty(logp, ref, kind)).sum(-1)
    assert_close(expectation, kl_penalty(logp, ref, "full"))


def test_unknown_kind_and_wrong_full_shapes():
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k3'.*algorithm\.kl_penalty.*low_var_kl"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k3")
    with pytest.raises(ValueError, match=r"'full' needs full log-distributions of shape \(B, T, V\)"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "full")
    assert set(kl_names()) == {"kl", "abs", "mse", "low_var_kl", "full"}


def test_apply_kl_penalty_hand_values():
    mask = lengths_to_mask([3, 2, 1], 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN], [-1.0, NAN, NAN]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.6, NAN], [1.0, NAN, NAN]])
    new, metrics = apply_kl_penalty(rewards, kl, 0.1, mask)
    # r - 0.1 kl on valid tokens, 0 on padding
    assert_close(new, torch.tensor([[-0.01, -0.02, 0.97], [-0.04, 1.94, 0.0], [-1.1, 0.0, 0.0]]))
    # per-sequence mean KL 0.2, 0.5, 1.0 -> mean 1.7 / 3
    assert metrics["kl"] == pytest.approx(1.7 / 3)
    assert metrics["kl_coef"] == 0.1


def test_fixed_controller_never_moves():
    ctrl = build_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_controller_follows_ziegler_update():
    ctrl = build_kl_controller("adaptive", kl_coef=0.1, kl_target=0.1, kl_horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    # KL 0.15 vs target 0.1: error 0.5 clipped to 0.2 -> x (1 + 0.2 * 10 / 100) = 0.102
    ctrl.update(current_kl=0.15, n_steps=10)
    assert ctrl.value == pytest.approx(0.102)
    # KL 0.095: error -0.05 (not clipped) -> x (1 - 0.05 * 10 / 100) = 0.102 * 0.995 = 0.10149
    ctrl.update(current_kl=0.095, n_steps=10)
    assert ctrl.value == pytest.approx(0.10149)
    # KL 0: error -1 clipped to -0.2 -> x 0.98
    ctrl.update(current_kl=0.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.10149 * 0.98)
    restored = AdaptiveKLController(1.0, 0.1, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_controller_config_errors():
    with pytest.raises(ValueError, match=r"unknown kl_type 'pid'.*algorithm\.kl_type"):
        build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="kl_target > 0"):
        build_kl_controller("adaptive", 0.1, kl_target=0.0)


def test_kl_loss_hand_value_and_gradient():
    mask = lengths_to_mask([2, 2, 1], 2)
    logprobs = LOGPROBS.clone().masked_fill(~mask, 50.0).requires_grad_()
    ref = REF_LOGPROBS.masked_fill(~mask, NAN)
    loss = kl_loss(logprobs, ref, mask, "low_var_kl", "token")
    # token mean of k3 over the 5 valid tokens (d = 0.5, -1, 0, 2, -0.25)
    assert_close(loss, torch.tensor((k3(0.5) + k3(-1.0) + k3(0.0) + k3(2.0) + k3(-0.25)) / 5))
    # d k3 / d logprob = 1 - exp(-d), / 5 tokens; padding: 0
    (grad,) = torch.autograd.grad(loss, logprobs)
    d = torch.tensor([[0.5, -1.0], [0.0, 2.0], [-0.25, 0.0]])
    assert_close(grad, torch.where(mask, (1 - torch.exp(-d)) / 5, 0.0))


def test_kl_loss_full_and_seq_mode():
    # p = (1/2, 1/4, 1/4) vs q = (1/4, 1/4, 1/2) at every valid token: KL = ln(2)/4 per token,
    # so every aggregation of it in "seq" mode is ln(2)/4; the padding row holds NaN
    p = torch.tensor([0.5, 0.25, 0.25]).log().expand(3, 2, 3).clone()
    q = torch.tensor([0.25, 0.25, 0.5]).log().expand(3, 2, 3).clone()
    mask = lengths_to_mask([2, 1, 0], 2)
    p[2] = NAN
    assert_close(kl_loss(p, q, mask, "full", "seq"), torch.tensor(math.log(2) / 4))
