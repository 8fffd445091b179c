"""Issue 33's methods against hand-derived numbers: Clip-Cov, KL-Cov, GPG (loss and advantage),
the two token gates (80/20 high-entropy tokens, DeepSeek-V3.2's off-policy sequence mask), the
importance-weighted KL and token-sum aggregation. Each derivation is in the comment above its test;
where verl or TRL ship the method, the comment says what their definition gives for the same case."""

from __future__ import annotations

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask, policy_loss_inputs
from torch.testing import assert_close

from easyvlm.algorithms import AdvantageInputs, PolicyLossInputs, aggregate_loss, get_advantage, get_policy_loss, kl_loss
from easyvlm.algorithms.policy_losses import token_covariance
from easyvlm.algorithms.token_filters import high_entropy_gate, off_policy_sequence_gate

NAN = float("nan")


def inputs_for(logprobs, ratios, advantages, lengths, **kwargs) -> PolicyLossInputs:
    """(B, T) lists; padding (beyond ``lengths``) filled with NaN in everything but logprobs."""
    mask = lengths_to_mask(lengths, len(logprobs[0]))
    logprobs = torch.tensor(logprobs).requires_grad_()
    old = (logprobs.detach() - torch.log(torch.tensor(ratios))).masked_fill(~mask, NAN)
    return policy_loss_inputs(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor(advantages).masked_fill(~mask, NAN),
        response_mask=mask, **kwargs,
    )


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov
# Two rows, lengths 3 and 2 (N = 5 valid tokens). A = [2, 2, 2] and [-3, -3]: mean(A) = 0.
# log pi = [-1, -0.5, -2] and [-1, -3]: mean = -7.5 / 5 = -1.5, centred [0.5, 1, -0.5] and [0.5, -1.5].
# Cov = A_c * logp_c = [1, 2, -1] and [-1.5, 4.5].
COV_LOGPROBS = [[-1.0, -0.5, -2.0], [-1.0, -3.0, 0.0]]
COV_ADVANTAGES = [[2.0, 2.0, 2.0], [-3.0, -3.0, 0.0]]
COV_LENGTHS = [3, 2]


def test_token_covariance_hand_values():
    inputs = inputs_for(COV_LOGPROBS, [[1.0] * 3] * 2, COV_ADVANTAGES, COV_LENGTHS)
    cov = token_covariance(inputs.advantages.nan_to_num(), inputs.logprobs, inputs.response_mask)
    assert_close(cov, torch.tensor([[1.0, 2.0, -1.0], [-1.5, 4.5, 0.0]]))


# Clip-Cov, band (1, 5) (verl's defaults), clip_cov_ratio 0.4: k = max(int(0.4 * 5), 1) = 2.
# Ratios [1, 1, 1] and [1, 0.5]: token (1, 1) has A < 0 and r = 0.5 < 0.8, so PPO's clip is active
# there and it is no candidate although its Cov 4.5 is in the band; (0, 0) has Cov 1.0, not > 1. The
# only candidate is (0, 1) (Cov 2): fewer than k, so it is detached whatever the random draw.
# PPO token losses: row 0: -2 r = -2 each; row 1: 3 r = 3, and max(3 * 0.5, 3 * 0.8) = 2.4.
# loss = (-2 + 0 - 2 + 3 + 2.4) / 5 = 0.28.
# d loss / d logp = -A r / 5 where unclipped and not detached: [-0.4, 0, -0.4], [0.6, 0 (clipped), 0].
# verl's compute_policy_loss_clip_cov gives the same loss and gradient on this case (its cov_all uses
# masked means too, excludes clip_by_origin tokens and draws min(k, candidates)); its metric
# pg_clipfrac is our pg_cov_frac (0.2 here).
def test_clip_cov_hand_values_and_gradient():
    inputs = inputs_for(COV_LOGPROBS, [[1.0, 1.0, 1.0], [1.0, 0.5, 1.0]], COV_ADVANTAGES, COV_LENGTHS, clip_cov_ratio=0.4,
                        clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss, metrics = get_policy_loss("clip_cov")(inputs)
    assert loss.item() == pytest.approx(0.28, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-0.4, 0.0, -0.4], [0.6, 0.0, 0.0]]))
    assert metrics["pg_cov_frac"] == pytest.approx(0.2)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2)
    assert metrics["pg_clipfrac_higher"] == 0.0


# The band decides the candidates: with clip_cov_ub = 2 the only in-band token (0, 1) (Cov exactly 2)
# falls out, nothing is detached and the loss is the plain PPO one: (-2 - 2 - 2 + 3 + 2.4) / 5 = -0.12.
def test_clip_cov_band_limits_the_candidates():
    inputs = inputs_for(COV_LOGPROBS, [[1.0, 1.0, 1.0], [1.0, 0.5, 1.0]], COV_ADVANTAGES, COV_LENGTHS, clip_cov_ratio=0.4,
                        clip_cov_lb=1.0, clip_cov_ub=2.0)
    loss, metrics = get_policy_loss("clip_cov")(inputs)
    assert loss.item() == pytest.approx(-0.12, abs=1e-6)
    assert metrics["pg_cov_frac"] == 0.0


# With every ratio 1 nothing is clipped: candidates (0, 1) (Cov 2) and (1, 1) (Cov 4.5); the default
# ratio 0.0002 gives k = max(int(0.001), 1) = 1: exactly one of the two is detached, at random.
# Token losses -A: [-2, -2, -2], [3, 3]; sum 0. Detaching (0, 1) leaves 2 / 5 = 0.4; (1, 1): -3 / 5.
def test_clip_cov_detaches_exactly_k_of_the_candidates_at_random():
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        inputs = inputs_for(COV_LOGPROBS, [[1.0] * 3] * 2, COV_ADVANTAGES, COV_LENGTHS)
        loss, metrics = get_policy_loss("clip_cov")(inputs)
        assert metrics["pg_cov_frac"] == pytest.approx(0.2)
        seen.add(round(loss.item(), 6))
    assert seen == {0.4, -0.6}


# KL-Cov, kl_cov_ratio 0.4 -> k = 2 tokens with the largest Cov: (1, 1) (4.5) and (0, 1) (2).
# Ratios [1, e^0.5, 1] and [1, e^-1]; no clip. Token losses -A r: -2, -2 e^0.5, -2 | 3, 3 e^-1, and the
# selected ones add ppo_kl_coef |log r|: +0.5 at (0, 1), +1 at (1, 1).
# loss = (0.5 - 2 e^0.5 + 3 e^-1) / 5 = (0.5 - 3.2974425 + 1.1036383) / 5 = -0.3387608.
# d/dlogp: -A r + sign(log r) on selected tokens, / 5: [-2, -2 e^0.5 + 1, -2] / 5, [3, 3 e^-1 - 1] / 5.
# verl's compute_policy_loss_kl_cov gives the same loss and gradient (no clip, top-k by Cov among valid
# tokens, + ppo_kl_coef |log r|); its ppo_kl metric is mean |log r| (0.3), ours the k1 mean.
def test_kl_cov_hand_values_and_gradient():
    ratios = [[1.0, math.exp(0.5), 1.0], [1.0, math.exp(-1.0), 1.0]]
    inputs = inputs_for(COV_LOGPROBS, ratios, COV_ADVANTAGES, COV_LENGTHS, kl_cov_ratio=0.4, ppo_kl_coef=1.0)
    loss, metrics = get_policy_loss("kl_cov")(inputs)
    e5, em1 = math.exp(0.5), math.exp(-1.0)
    assert loss.item() == pytest.approx((0.5 - 2 * e5 + 3 * em1) / 5, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-2.0, -2 * e5 + 1, -2.0], [3.0, 3 * em1 - 1, 0.0]]) / 5)
    assert metrics["pg_cov_frac"] == pytest.approx(0.4)


# ----------------------------------------------------------------------------- GPG
# Loss: -A log pi, ratios ignored (3 and 0.1 here). log pi [-1, -2] | [-0.5]; A [1, 1] | [-2].
# Token losses 1, 2 | -1: loss = 2 / 3; d/dlogp = -A / 3 = [-1/3, -1/3] | [2/3]. verl's gpg: the same.
def test_gpg_loss_hand_values_and_gradient():
    inputs = inputs_for([[-1.0, -2.0], [-0.5, 0.0]], [[3.0, 0.1], [3.0, 1.0]], [[1.0, 1.0], [-2.0, 0.0]], [2, 1])
    loss, _ = get_policy_loss("gpg")(inputs)
    assert loss.item() == pytest.approx(2 / 3)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))


# Advantage: groups g0 rewards [1, 0, 1, 0] (mean 0.5), g1 [1, 1, 1] (all equal: invalid).
# B = 7, M = 3: alpha = 7 / 4 = 1.75; A = 1.75 * (r - 0.5) = +-0.875 in g0, 0 in g1.
# verl's compute_gpg_outcome_advantage counts alpha = B / (non-zero rewards) = 7 / 5 = 1.4, so it
# gives +-0.7 here: the paper's M counts the samples of single-valued groups, which is what we use.
def test_gpg_advantage_hand_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    mask = lengths_to_mask([2, 1, 2, 1, 1, 2, 1], 2)
    token_rewards = torch.zeros(7, 2)
    token_rewards[torch.arange(7), mask.sum(-1) - 1] = rewards  # the reward sits at the last valid token
    out = get_advantage("gpg")(AdvantageInputs(token_rewards, mask, torch.tensor([0, 0, 0, 0, 1, 1, 1])))
    expected = torch.tensor([0.875, -0.875, 0.875, -0.875, 0.0, 0.0, 0.0])
    assert_close(out.advantages, expected.unsqueeze(-1) * mask)


def test_gpg_advantage_is_zero_when_no_group_has_a_signal():
    mask = lengths_to_mask([1, 1], 1)
    out = get_advantage("gpg")(AdvantageInputs(torch.ones(2, 1), mask, torch.tensor([0, 0])))
    assert torch.equal(out.advantages, torch.zeros(2, 1))


# ----------------------------------------------------------------------------- token gates
# Entropies [0.1, 2.0, 0.5] | [1.0, (3.0 padding)]: valid sorted [0.1, 0.5, 1.0, 2.0].
# rho 0.5 -> 0.5 quantile at position 1.5: 0.5 + 0.5 (1.0 - 0.5) = 0.75: keep 2.0 and 1.0.
# rho 0.25 -> 0.75 quantile at 2.25: 1.0 + 0.25 (2.0 - 1.0) = 1.25: keep 2.0 only. The padding's 3.0
# is never kept. TRL's get_high_entropy_mask (torch.quantile at 1 - rho, entropy >= threshold) agrees.
@pytest.mark.parametrize(("rho", "expected"), [
    (0.5, [[False, True, False], [True, False, False]]),
    (0.25, [[False, True, False], [False, False, False]]),
    (1.0, [[True, True, True], [True, False, False]]),
])
def test_high_entropy_gate_hand_values(rho, expected):
    entropies = torch.tensor([[0.1, 2.0, 0.5], [1.0, 3.0, 0.0]])
    mask = lengths_to_mask([3, 1], 3)
    assert torch.equal(high_entropy_gate(entropies, mask, rho), torch.tensor(expected))


# delta 0.5; mean over valid tokens of log pi_sampler - log pi_theta:
# row 0: A < 0, (1 + 1) / 2 = 1 > 0.5: dropped. row 1: same ratio, A > 0: kept.
# row 2: A < 0, (0.2 + 0.4) / 2 = 0.3: kept. row 3: A < 0, exactly 0.5 (one token; padding NaN): kept
# (TRL keeps avg_seq_kl <= delta).
def test_off_policy_sequence_gate_hand_values():
    mask = lengths_to_mask([2, 2, 2, 1], 2)
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, NAN]])
    logprobs = torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.2, -1.4], [-1.5, NAN]])
    advantages = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, NAN]])
    gate = off_policy_sequence_gate(advantages, logprobs, sampler, mask, 0.5)
    assert torch.equal(gate, mask & torch.tensor([[False], [True], [True], [True]]))


# A gated-off token has loss 0 but stays in the normaliser: default loss, all ratios 1, A [1, 1] | [-2]:
# token losses -A = [-1, -1] | [2]; gate [[T, F], [T]] -> (-1 + 2) / 3 = 1/3; gradient -A gate / 3.
def test_token_gate_zeroes_losses_but_keeps_the_normaliser():
    gate = torch.tensor([[True, False], [True, False]])
    inputs = inputs_for([[-1.0, -1.0], [-1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [-2.0, 0.0]], [2, 1],
                        token_gate=gate)
    loss, _ = get_policy_loss("default")(inputs)
    assert loss.item() == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-1 / 3, 0.0], [2 / 3, 0.0]]))


# GMPO with a gate: row 0 of test_policy_losses' GMPO case (A = +1, d = [-0.5, 0.5] -> d' = [-0.5, 0.3])
# with token 1 gated off: d' = [-0.5, 0] -> rho = e^-0.25, loss_0 = -e^-0.25 ("seq": one sequence).
# d loss / d logp_0 = -rho / 2 (the mean over 2 tokens); token 1 gets no gradient.
def test_geo_mean_counts_a_gated_token_as_ratio_one():
    inputs = inputs_for([[-1.0, -1.0]], [[math.exp(-0.5), math.exp(0.5)]], [[1.0, 1.0]], [2],
                        token_gate=torch.tensor([[True, False]]), loss_avg_mode="seq")
    loss, _ = get_policy_loss("geo_mean")(inputs)
    assert loss.item() == pytest.approx(-math.exp(-0.25))
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-math.exp(-0.25) / 2, 0.0]]))


# ----------------------------------------------------------------------------- unbiased KL
# log pi [-1, -2], ref [-1.5, -2], old [-1.2, -2.5]. k3 = e^x - x - 1 with x = ref - logp = [-0.5, 0]:
# [e^-0.5 - 0.5, 0] = [0.1065307, 0]; r = e^(logp - old) = [e^0.2, e^0.5].
# loss = mean(r k3) = e^0.2 * 0.1065307 / 2 = 0.0650587.
# d/dlogp (r k3) = r k3 + r (1 - e^x): token 0: e^0.2 (0.1065307 + 1 - e^-0.5) = e^0.2 / 2; token 1: 0.
# TRL (use_bias_correction_kl: per_token_kl * coef_1, coef_1 = exp(logp - old) with its gradient) gives the
# same value and gradient; it has no clamp of k3 at 10 or of the log-ratio at +-20 (not reached here).
def test_bias_corrected_kl_hand_values_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref, old = torch.tensor([[-1.5, -2.0]]), torch.tensor([[-1.2, -2.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    k3 = math.exp(-0.5) - 0.5
    loss = kl_loss(logprobs, ref, mask, "low_var_kl", old_logprobs=old)
    assert loss.item() == pytest.approx(math.exp(0.2) * k3 / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad, torch.tensor([[math.exp(0.2) / 4, 0.0]]))


# Unbiasedness, by enumeration: tokens drawn from pi_old, each weighted by its probability, estimate
# sum_v pi_old(v) r(v) k3(v) = sum_v pi_theta(v) k3(v) = KL(pi_theta || pi_ref) exactly (k3 is unbiased
# under pi_theta); the plain k3 under pi_old does not.
def test_bias_corrected_kl_is_unbiased_under_the_sampling_policy():
    old, theta, ref = (torch.log(torch.tensor(p)) for p in ([0.6, 0.3, 0.1], [0.3, 0.5, 0.2], [0.2, 0.2, 0.6]))
    one = torch.ones(1, 1, dtype=torch.bool)

    def estimate(weighted: bool) -> float:
        return sum(
            old[v].exp().item() * kl_loss(theta[v].view(1, 1), ref[v].view(1, 1), one, "low_var_kl",
                                          old_logprobs=old[v].view(1, 1) if weighted else None).item()
            for v in range(3)
        )

    exact = (theta.exp() * (theta - ref)).sum().item()
    assert estimate(weighted=True) == pytest.approx(exact, rel=1e-5)
    assert abs(estimate(weighted=False) - exact) > 0.05


# ----------------------------------------------------------------------------- token-sum
# token-sum = plain sum over valid tokens: 1 + 2 + 3 = 6, whatever normaliser is passed. verl's agg_loss
# "token-sum" returns masked_sum * dp_size on each rank, i.e. 6 with one rank: the same (the actor's
# grad_scale plays the part of its * dp_size; the split test in test_aggregation.py covers token-sum).
def test_token_sum_ignores_the_normaliser():
    losses = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]])
    mask = lengths_to_mask([2, 1], 3)
    for normalizer in (None, 3.0, 123.0):
        assert aggregate_loss(losses, mask, "token-sum", normalizer).item() == 6.0
