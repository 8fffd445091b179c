"""Rollout correction (verl's decoupled mode): importance weights and rejection masks, by hand.

The batch used throughout: two sequences, mask [[1,1,1,0],[1,1,0,0]], and per valid token the
ratio r = pi_old / pi_rollout = [[3, 1/2, 1, -], [1/4, 1, -, -]] (log r = old - rollout; the
padding holds a huge log ratio that must never count).
"""

from __future__ import annotations

import math

import pytest
import torch

from easyvlm.algorithms.policy_losses import PolicyLossInputs, get_policy_loss
from easyvlm.algorithms.rollout_correction import (
    RolloutCorrection,
    RolloutCorrectionConfig,
    importance_weights,
    parse_is_threshold,
    parse_rejection,
    parse_rollout_correction,
    rejection_mask,
    rollout_correction,
)

MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
RATIOS = torch.tensor([[3.0, 0.5, 1.0, math.exp(30.0)], [0.25, 1.0, math.exp(-30.0), 1.0]])
LOG_RATIO = torch.log(RATIOS)
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.7, -2.5, -0.1]])
OLD = ROLLOUT + LOG_RATIO


def corr(**kw) -> RolloutCorrection:
    return RolloutCorrection(**kw)


def test_token_tis_truncates_at_the_threshold():
    w, m = importance_weights(LOG_RATIO, MASK, corr(rollout_is="token", is_upper=2.0))
    # raw [3, .5, 1 | .25, 1] -> min(., 2) = [2, .5, 1 | .25, 1]; padding 0
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0], [0.25, 1.0, 0.0, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx(4.75 / 5)
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_min"] == pytest.approx(0.25)
    # raw above 2: the 3 (1 of 5); raw below 1/2: the 1/4 (0.5 itself is not below)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.2)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(0.2)
    # Kish: mean(w)^2 / mean(w^2) = 0.95^2 / ((4 + .25 + 1 + .0625 + 1) / 5) = 0.9025 / 1.2625
    assert m["rollout_is_eff_sample_size"] == pytest.approx(0.9025 / 1.2625)
    assert not w.requires_grad


def test_sequence_is_is_the_product_over_the_sequence_and_batch_normalizes_over_sequences():
    w, m = importance_weights(LOG_RATIO, MASK, corr(rollout_is="sequence", is_upper=2.0))
    # row 1: 3 * 1/2 * 1 = 1.5 (<= 2, kept); row 2: 1/4 * 1 = 0.25
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5, 0.0], [0.25, 0.25, 0.0, 0.0]]))
    w, m = importance_weights(LOG_RATIO, MASK, corr(rollout_is="sequence", is_upper=2.0, batch_normalize=True))
    # one weight per sequence: mean (1.5 + 0.25) / 2 = 0.875
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(0.875)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5, 0.0], [0.25, 0.25, 0.0, 0.0]]) / 0.875)
    # a long sequence whose product overflows float32 is clamped at exp(20), then truncated
    huge = torch.full((1, 40), math.log(3.0))
    w, _ = importance_weights(huge, torch.ones(1, 40, dtype=torch.bool), corr(rollout_is="sequence", is_upper=5.0))
    assert torch.all(w == 5.0)


def test_token_batch_normalize_divides_by_the_token_mean():
    w, m = importance_weights(LOG_RATIO, MASK, corr(rollout_is="token", is_upper=2.0, batch_normalize=True))
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(0.95)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0], [0.25, 1.0, 0.0, 0.0]]) / 0.95)


def test_icepop_zeroes_weights_outside_the_band():
    upper, lower = parse_is_threshold("0.5_2.0")
    w, m = importance_weights(LOG_RATIO, MASK, corr(rollout_is="token", is_upper=upper, is_lower=lower))
    # 3 > 2 -> 0; 0.5 inside (inclusive); 0.25 < 0.5 -> 0
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))


def test_token_k1_rejection_keeps_ratios_inside_the_band():
    rules = parse_rejection("token_k1", "2.0")  # a single u: l = 1/u
    keep, m = rejection_mask(LOG_RATIO, MASK, rules)
    # k1 = -log r in [log 1/2, log 2] <=> r in [1/2, 2]: 3 and 1/4 go
    assert keep.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)  # both sequences lost a token
    # k1 mean over valid tokens: -(ln 3 + ln .5 + 0 + ln .25 + 0) / 5
    assert m["rollout_rs_token_k1_mean"] == pytest.approx(-(math.log(3) + math.log(0.5) + math.log(0.25)) / 5)


def test_k1_bounds_follow_verls_convention():
    # "0.6_1.4" keeps log .6 <= -log r <= log 1.4, i.e. r in [1/1.4, 1/.6] = [0.714, 1.667]
    rules = parse_rejection("token_k1", "0.6_1.4")
    ratios = torch.log(torch.tensor([[0.7, 0.72, 1.6, 1.7]]))
    keep, _ = rejection_mask(ratios, torch.ones(1, 4, dtype=torch.bool), rules)
    assert keep.tolist() == [[False, True, True, False]]


def test_sequence_rejection_criteria():
    # k3 = r - 1 - ln r: r=3: 2 - ln 3 = .9014; r=1/2: ln 2 - .5 = .1931; r=1/4: ln 4 - .75 = .6363; r=1: 0
    # row means: (.9014 + .1931) / 3 = .3648 and .6363 / 2 = .3181: 0.35 rejects row 1 only
    keep, m = rejection_mask(LOG_RATIO, MASK, parse_rejection("seq_mean_k3", "0.35"))
    assert keep.tolist() == [[False, False, False, False], [True, True, False, False]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_rs_seq_mean_k3_seq_masked_fraction"] == pytest.approx(0.5)
    # k2 = (ln r)^2 / 2: .6035, .2402, 0 | .9609, 0; max per row .6035 / .9609: 0.7 rejects row 2
    keep, _ = rejection_mask(LOG_RATIO, MASK, parse_rejection("seq_max_k2", 0.7))
    assert keep.tolist() == [[True, True, True, False], [False, False, False, False]]
    # sum of k1 = -sum ln r: row 1 -ln 1.5 = -.405 in [ln .5, ln 2]; row 2 ln 4 = 1.386 above ln 2
    keep, _ = rejection_mask(LOG_RATIO, MASK, parse_rejection("seq_sum_k1", "0.5_2.0"))
    assert keep.tolist() == [[True, True, True, False], [False, False, False, False]]
    # seq_sum_k3 .9014 + .1931 = 1.0945 and .6363: 1.0 rejects row 1
    keep, _ = rejection_mask(LOG_RATIO, MASK, parse_rejection("seq_sum_k3", "1.0"))
    assert keep.tolist() == [[False, False, False, False], [True, True, False, False]]


def test_several_criteria_must_all_pass():
    rules = parse_rejection("token_k1, seq_max_k2", "2.0,0.7")
    keep, m = rejection_mask(LOG_RATIO, MASK, rules)
    # token_k1 drops the 3 and the 1/4; seq_max_k2 drops row 2: only row 1's 1/2 and 1 remain
    assert keep.tolist() == [[False, True, True, False], [False, False, False, False]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(2 / 5)


def test_the_combined_correction_zeroes_the_weights_of_rejected_tokens():
    c = parse_rollout_correction(RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold="0.7"))
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK, c)
    assert keep.tolist() == [[True, True, True, False], [False, False, False, False]]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert "rollout_is_mean" in m and "rollout_rs_masked_fraction" in m
    # nothing set: no weights, the mask unchanged
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK, parse_rollout_correction(RolloutCorrectionConfig()))
    assert weights is None and torch.equal(keep, MASK) and m == {}


def test_weights_multiply_each_token_loss():
    # on-policy (logprobs = old): r = 1, so the PPO token loss is -A; weighted: -A w
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    weights = torch.tensor([[2.0, 0.5, 1.0]])
    for name in ("default", "gspo", "cispo", "sapo"):
        inputs = PolicyLossInputs(logprobs, logprobs.detach(), advantages, mask, rollout_is_weights=weights)
        loss, _ = get_policy_loss(name)(inputs)
        if name in ("default", "gspo"):  # cispo's and sapo's values differ (docstrings); their gradients agree
            # (-2 + 0.5 - 2) / 3 tokens
            assert loss.item() == pytest.approx(-3.5 / 3), name
        (grad,) = torch.autograd.grad(loss, logprobs)
        # d/dlogp of -A w r (r = exp(logp - old)) at r = 1: -A w / 3; gspo spreads its sequence
        # ratio's gradient over the tokens: each token gets sum_t(-A_t w_t)/3 * 1/3
        expected = torch.tensor([[-2.0, 0.5, -2.0]]) / 3 if name != "gspo" else torch.full((1, 3), -3.5 / 9)
        torch.testing.assert_close(grad, expected, msg=name)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("abc", "must be a number"),
        ("2_1", "lower bound must not exceed"),
        ("0", "finite numbers > 0"),
        ("-1_2", "finite numbers > 0"),
    ],
)
def test_bad_is_thresholds_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_is_threshold(spec)


@pytest.mark.parametrize(
    "options, threshold, message",
    [
        ("seq_mean_k4", "1", "unknown criteria"),
        ("seq_max_k1", "1", "unknown criteria"),  # verl has no max of k1 either
        ("token_k3", None, "must be set"),
        ("token_k3,seq_sum_k2", "1,2,3", "3 entries for 2 criteria"),
        ("token_k3", "0.5_2", "single upper bound"),
    ],
)
def test_bad_rejection_specs_are_named(options, threshold, message):
    with pytest.raises(ValueError, match=message):
        parse_rejection(options, threshold)
