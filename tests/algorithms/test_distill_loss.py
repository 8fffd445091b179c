"""On-policy distillation's losses (easyvlm.algorithms.distill, kl.kl_full): hand-derived values and gradients.

Notation: z the student's logits at a position, p = softmax(z) its distribution over a 3-word
vocabulary, q the teacher's, y the sampled token, d = log p(y) - log q(y). Everything in float64.
The two gradients every test below uses, derived once:

- d/dz_j log p(y) = onehot(y)_j - p_j, so the one-sample surrogate (value d, d detached) has the
  gradient d * (onehot(y) - p) (divided by the token count N in the "token" mode);
- KL(p || q) = sum_v p_v (log p_v - log q_v); with d p_v / d z_j = p_v (delta_vj - p_j):
  dKL/dz_j = sum_v p_v (delta_vj - p_j)(log p_v - log q_v) + sum_v p_v (delta_vj - p_j)
           = p_j (log p_j - log q_j) - p_j KL + (p_j - p_j) = p_j (log p_j - log q_j - KL).
  And E_{y~p}[d_y (onehot(y) - p)]_j = p_j d_j - p_j sum_y p_y d_y = p_j (d_j - KL): the same, the
  score-function identity that makes the surrogate an unbiased estimate of the KL's gradient.
"""

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask, policy_loss_inputs
from torch.testing import assert_close

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.distill import distill_advantages, distill_loss, distill_metrics, reverse_kl_surrogate
from easyvlm.algorithms.kl import kl_full
from easyvlm.algorithms.masked import zero_masked
from easyvlm.algorithms.policy_losses import get_policy_loss

NAN = float("nan")
LN2 = math.log(2)
F64 = torch.float64

# ----------------------------------------------------------------------------- the one-sample case
# B = 2, T = 2, V = 3; position (1, 1) is padding. Logits z = log p, so softmax(z) = p exactly
# (the p sum to 1). Sampled tokens and the teacher's log-prob of each:
#   (0, 0): p = (0.5, 0.25, 0.25), y = 0, q(y) = 0.25  ->  d = ln 0.5 - ln 0.25 = ln 2       =  0.693147
#   (0, 1): p = (0.2, 0.3, 0.5),   y = 2, q(y) = 0.1   ->  d = ln 0.5 - ln 0.1  = ln 5       =  1.609438
#   (1, 0): p = (0.1, 0.6, 0.3),   y = 1, q(y) = 0.9   ->  d = ln 0.6 - ln 0.9  = ln (2/3)   = -0.405465
#   (1, 1): padding: the student's log-prob and the teacher's are NaN there
PROBS = [[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], [[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]]
TOKENS = [[0, 2], [1, 0]]
TEACHER_P = [[0.25, 0.1], [0.9, NAN]]
LENGTHS = [2, 1]
D = [[math.log(0.5 / 0.25), math.log(0.5 / 0.1)], [math.log(0.6 / 0.9), 0.0]]  # 0 = padding (unused)
N_TOKENS = 3


def onesample_case():
    """(logits leaf (2, 2, 3), student log-probs (2, 2) with NaN at padding, teacher log-probs, mask)."""
    mask = lengths_to_mask(LENGTHS, 2)
    logits = torch.tensor(PROBS, dtype=F64).log().requires_grad_()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS).unsqueeze(-1)).squeeze(-1)
    logprobs = logprobs.masked_fill(~mask, NAN)  # garbage at padding (masked_fill passes no gradient there)
    teacher = torch.tensor(TEACHER_P, dtype=F64).log()
    return logits, logprobs, teacher, mask


def hand_surrogate_grad() -> tuple[list, list]:
    """d(token-mean surrogate)/dz = d (onehot(y) - p) / N at valid positions, 0 at padding; and
    d/d log p(y) = d / N. With the numbers (N = 3):
      (0, 0): ln2 / 3 * ( 0.5, -0.25, -0.25) = ( 0.115525, -0.057762, -0.057762)
      (0, 1): ln5 / 3 * (-0.2, -0.3,   0.5 ) = (-0.107296, -0.160944,  0.268240)
      (1, 0): ln(2/3) / 3 * (-0.1, 0.4, -0.3) = ( 0.013516, -0.054062,  0.040547)
      (1, 1): 0
    """
    grad_z, grad_logp = [], []
    for b in range(2):
        row_z, row_lp = [], []
        for t in range(2):
            valid = t < LENGTHS[b]
            d = D[b][t] if valid else 0.0
            onehot = [1.0 if v == TOKENS[b][t] else 0.0 for v in range(3)]
            row_z.append([d * (onehot[v] - PROBS[b][t][v]) / N_TOKENS for v in range(3)])
            row_lp.append(d / N_TOKENS)
        grad_z.append(row_z)
        grad_logp.append(row_lp)
    return grad_z, grad_logp


def test_hand_gradient_numbers():
    # the helper's numbers against the docstring's, so that a slip in either shows
    grad_z, grad_logp = hand_surrogate_grad()
    assert grad_z[0][0] == pytest.approx([0.115525, -0.057762, -0.057762], abs=1e-6)
    assert grad_z[0][1] == pytest.approx([-0.107296, -0.160944, 0.268240], abs=1e-6)
    assert grad_z[1][0] == pytest.approx([0.013516, -0.054062, 0.040547], abs=1e-6)
    assert grad_z[1][1] == [0.0, 0.0, 0.0]
    assert grad_logp[0] == pytest.approx([LN2 / 3, math.log(5) / 3])
    assert grad_logp[1] == pytest.approx([math.log(2 / 3) / 3, 0.0])


def test_onesample_surrogate_value_and_gradient():
    # value: token mean of d over the 3 valid tokens = (ln 2 + ln 5 + ln(2/3)) / 3 = ln(20/3) / 3 = 0.632373
    logits, logprobs, teacher, mask = onesample_case()
    loss = distill_loss(logprobs, teacher, mask, loss_avg_mode="token")
    assert loss.dtype == F64
    assert_close(loss, torch.tensor(math.log(20 / 3) / 3, dtype=F64))
    assert loss.item() == pytest.approx(0.632373, abs=1e-6)
    grad_z, grad_logp = torch.autograd.grad(loss, [logits, logprobs])
    expected_z, expected_logp = hand_surrogate_grad()
    # the padding's NaN reaches neither the value nor the gradient (0 there, not NaN)
    assert_close(grad_logp, torch.tensor(expected_logp, dtype=F64))
    assert_close(grad_z, torch.tensor(expected_z, dtype=F64))


def test_onesample_surrogate_other_modes():
    # "seq": (mean of row 0 + mean of row 1) / 2 = ((ln2 + ln5) / 2 + ln(2/3)) / 2 = (ln10 / 2 + ln(2/3)) / 2
    # "seq-mean-token-sum": (ln2 + ln5 + ln(2/3)) / 2 sequences = ln(20/3) / 2
    _, logprobs, teacher, mask = onesample_case()
    assert_close(distill_loss(logprobs, teacher, mask, "seq"),
                 torch.tensor((math.log(10) / 2 + math.log(2 / 3)) / 2, dtype=F64))
    assert_close(distill_loss(logprobs, teacher, mask, "seq-mean-token-sum"),
                 torch.tensor(math.log(20 / 3) / 2, dtype=F64))
    # a mini-batch normaliser of 6 tokens (this micro-batch being half of it) halves the token mean
    assert_close(distill_loss(logprobs, teacher, mask, "token", normalizer=6.0),
                 torch.tensor(math.log(20 / 3) / 6, dtype=F64))


def test_reverse_kl_surrogate_per_token():
    # per token: value d, d(value)/d log p = d (the detached d times the gradient of log p)
    logp = torch.tensor([[-1.0, -0.25]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-3.0, -0.5]], dtype=F64)
    out = reverse_kl_surrogate(logp, teacher)  # d = (2, 0.25)
    assert_close(out, torch.tensor([[2.0, 0.25]], dtype=F64))
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert_close(grad, torch.tensor([[2.0, 0.25]], dtype=F64))


# ----------------------------------------------------------------------------- the estimator property
# One position: p = (0.5, 0.25, 0.25), q = (0.25, 0.5, 0.25). log p - log q = (ln2, -ln2, 0),
# KL = 0.5 ln2 + 0.25 (-ln2) + 0 = 0.25 ln2 = 0.173287. dKL/dz_j = p_j (log p_j - log q_j - KL):
#   j = 0: 0.5  (ln2 - 0.25 ln2)  =  0.375  ln2 =  0.259930
#   j = 1: 0.25 (-ln2 - 0.25 ln2) = -0.3125 ln2 = -0.216608
#   j = 2: 0.25 (0 - 0.25 ln2)    = -0.0625 ln2 = -0.043322   (the three sum to 0: softmax's shift)
P_EST = [0.5, 0.25, 0.25]
Q_EST = [0.25, 0.5, 0.25]


def kl_grad_formula(p: list[float], q: list[float]) -> list[float]:
    """dKL(p || q)/dz_j = p_j (log p_j - log q_j - KL), from Python floats."""
    kl = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))
    return [pv * (math.log(pv) - math.log(qv) - kl) for pv, qv in zip(p, q)]


def surrogate_expected_grad(logits: torch.Tensor, teacher_logq: torch.Tensor) -> torch.Tensor:
    """sum_y p(y) * d/dz distill_loss at the one-token sample y (exact expectation over the vocabulary)."""
    probs = torch.softmax(logits.detach(), -1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    total = torch.zeros_like(logits)
    for y in range(logits.shape[-1]):
        logprob_y = torch.log_softmax(logits, -1)[y].view(1, 1)
        loss = distill_loss(logprob_y, teacher_logq[y].view(1, 1), mask, "token")
        (grad,) = torch.autograd.grad(loss, logits)
        total += probs[y] * grad
    return total


def test_kl_full_gradient_matches_hand_formula():
    assert kl_grad_formula(P_EST, Q_EST) == pytest.approx([0.375 * LN2, -0.3125 * LN2, -0.0625 * LN2])
    assert [0.375 * LN2, -0.3125 * LN2, -0.0625 * LN2] == pytest.approx([0.259930, -0.216608, -0.043322], abs=1e-6)
    logits = torch.tensor(P_EST, dtype=F64).log().requires_grad_()
    kl = kl_full(torch.log_softmax(logits, -1).view(1, 1, 3), torch.tensor(Q_EST, dtype=F64).log().view(1, 1, 3))
    assert_close(kl, torch.tensor([[0.25 * LN2]], dtype=F64))
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    assert_close(grad, torch.tensor(kl_grad_formula(P_EST, Q_EST), dtype=F64))


@pytest.mark.parametrize("case", ["hand", "random"])
def test_expected_surrogate_gradient_is_reverse_kl_gradient(case):
    # E_{y~p}[grad surrogate(y)] = p_j (d_j - KL) = dKL/dz_j (module doc). "hand": the numbers above;
    # "random": a 3-word position with random logits on both sides (no coincidence of round numbers)
    if case == "hand":
        logits = torch.tensor(P_EST, dtype=F64).log().requires_grad_()
        logq = torch.tensor(Q_EST, dtype=F64).log()
    else:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(3, generator=gen, dtype=F64).requires_grad_()
        logq = torch.log_softmax(torch.randn(3, generator=gen, dtype=F64), -1)
    expected = surrogate_expected_grad(logits, logq)
    kl = kl_full(torch.log_softmax(logits, -1).view(1, 1, 3), logq.view(1, 1, 3))
    (kl_grad,) = torch.autograd.grad(kl.sum(), logits)
    assert_close(expected, kl_grad, atol=1e-12, rtol=0)  # an identity: float64 rounding only
    p = torch.softmax(logits.detach(), -1).tolist()
    assert_close(kl_grad, torch.tensor(kl_grad_formula(p, torch.exp(logq).tolist()), dtype=F64), atol=1e-12, rtol=0)
    assert kl_grad.abs().max() > 0.01  # a gradient worth comparing


# ----------------------------------------------------------------------------- the full reverse KL
# B = 2, T = 2, V = 3; (1, 1) padding.
#   (0, 0): p = (0.5, 0.25, 0.25), q = (0.25, 0.5, 0.25): KL = 0.5 ln2 + 0.25 ln(1/2) + 0      = 0.25 ln2
#   (0, 1): p = (0.8, 0.1, 0.1),   q = (0.4, 0.4, 0.2):   KL = 0.8 ln2 + 0.1 ln(1/4) + 0.1 ln(1/2)
#                                                           = (0.8 - 0.2 - 0.1) ln2               = 0.5 ln2
#   (1, 0): p = (0.25, 0.25, 0.5), q = (0.5, 0.25, 0.25): KL = 0.25 ln(1/2) + 0 + 0.5 ln2       = 0.25 ln2
#   (1, 1): p = (0.9, 0.05, 0.05), q = (0.05, 0.05, 0.9): KL = 0.9 ln18 + 0 + 0.05 ln(1/18) = 0.85 ln18 = 2.456816
#           (padding: large, so that counting it would show)
# Aggregated: "token" = (0.25 + 0.5 + 0.25) ln2 / 3 = ln2 / 3 = 0.231049;
#   "seq-mean-token-sum" = (0.75 ln2 + 0.25 ln2) / 2 sequences = ln2 / 2 = 0.346574;
#   "seq" = ((0.25 + 0.5) / 2 + 0.25) ln2 / 2 = 0.3125 ln2 = 0.216608
FULL_P = [[[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]], [[0.25, 0.25, 0.5], [0.9, 0.05, 0.05]]]
FULL_Q = [[[0.25, 0.5, 0.25], [0.4, 0.4, 0.2]], [[0.5, 0.25, 0.25], [0.05, 0.05, 0.9]]]


def full_case():
    logits = torch.tensor(FULL_P, dtype=F64).log().requires_grad_()
    return logits, torch.tensor(FULL_Q, dtype=F64).log(), lengths_to_mask(LENGTHS, 2)


def test_kl_full_hand_values():
    logits, logq, _ = full_case()
    kl = kl_full(torch.log_softmax(logits, -1), logq)
    assert_close(kl, torch.tensor([[0.25 * LN2, 0.5 * LN2], [0.25 * LN2, 0.85 * math.log(18)]], dtype=F64))
    assert kl[0, 0].item() == pytest.approx(0.173287, abs=1e-6)
    assert kl[1, 1].item() == pytest.approx(2.456816, abs=1e-6)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token", LN2 / 3), ("seq-mean-token-sum", LN2 / 2), ("seq", 0.3125 * LN2)],
)
def test_kl_full_aggregated(mode, expected):
    logits, logq, mask = full_case()
    kl = kl_full(torch.log_softmax(logits, -1), logq)
    assert_close(aggregate_loss(kl, mask, mode), torch.tensor(expected, dtype=F64))
    # NaN in the padding's per-token KL stays out of the value too
    assert_close(aggregate_loss(kl.detach().masked_fill(~mask, NAN), mask, mode), torch.tensor(expected, dtype=F64))


def test_kl_full_token_mean_gradient():
    # d/dz of the token mean = p_j (log p_j - log q_j - KL) / 3 at valid positions, 0 at padding:
    #   (0, 0): (0.375, -0.3125, -0.0625) ln2 / 3
    #   (0, 1): p (ln2 - 0.5 ln2, -2 ln2 - 0.5 ln2, -ln2 - 0.5 ln2) = (0.4, -0.25, -0.15) ln2 / 3
    #   (1, 0): p (-ln2 - 0.25 ln2, 0 - 0.25 ln2, ln2 - 0.25 ln2) = (-0.3125, -0.0625, 0.375) ln2 / 3
    logits, logq, mask = full_case()
    loss = aggregate_loss(kl_full(torch.log_softmax(logits, -1), logq), mask, "token")
    (grad,) = torch.autograd.grad(loss, logits)
    expected = torch.tensor([[[0.375, -0.3125, -0.0625], [0.4, -0.25, -0.15]],
                             [[-0.3125, -0.0625, 0.375], [0.0, 0.0, 0.0]]], dtype=F64) * LN2 / 3
    assert_close(grad, expected)
    for b, t in [(0, 0), (0, 1), (1, 0)]:  # the table above is the formula's
        assert_close(grad[b, t], torch.tensor(kl_grad_formula(FULL_P[b][t], FULL_Q[b][t]), dtype=F64) / 3)


# ----------------------------------------------------------------------------- as reward
# B = 2, T = 3, lengths (3, 1), coef 0.5; NaN at padding in both inputs.
#   teacher = [[-0.5, -2.0, -1.0], [-3.0, pad, pad]], student = [[-1.5, -1.0, -1.0], [-0.5, pad, pad]]
#   A = 0.5 (teacher - student) = [[0.5 * 1, 0.5 * -1, 0], [0.5 * -2.5, 0, 0]] = [[0.5, -0.5, 0], [-1.25, 0, 0]]
ADV_TEACHER = [[-0.5, -2.0, -1.0], [-3.0, NAN, NAN]]
ADV_STUDENT = [[-1.5, -1.0, -1.0], [-0.5, NAN, NAN]]


def test_distill_advantages_hand_values():
    mask = lengths_to_mask([3, 1], 3)
    teacher, student = torch.tensor(ADV_TEACHER, dtype=F64), torch.tensor(ADV_STUDENT, dtype=F64)
    advantages = distill_advantages(teacher, student, mask, coef=0.5)
    assert_close(advantages, torch.tensor([[0.5, -0.5, 0.0], [-1.25, 0.0, 0.0]], dtype=F64))
    # coef 2: four times as much
    assert_close(distill_advantages(teacher, student, mask, coef=2.0),
                 torch.tensor([[2.0, -2.0, 0.0], [-5.0, 0.0, 0.0]], dtype=F64))


def test_distill_metrics_token_means():
    # reverse_kl (the one-sample estimate student - teacher) = [[-1, 1, 0], [2.5, pad, pad]]:
    #   mean over the 4 valid tokens = 2.5 / 4 = 0.625
    # teacher_logprob: (-0.5 - 2 - 1 - 3) / 4 = -1.625
    mask = lengths_to_mask([3, 1], 3)
    teacher = torch.tensor(ADV_TEACHER, dtype=F64)
    reverse_kl = (torch.tensor(ADV_STUDENT, dtype=F64) - teacher).requires_grad_()
    metrics = distill_metrics(reverse_kl, teacher, mask)
    assert metrics == {"reverse_kl": pytest.approx(0.625), "teacher_logprob": pytest.approx(-1.625)}
    assert all(type(v) is float for v in metrics.values())
    # no valid token: 0, not NaN
    empty = distill_metrics(reverse_kl, teacher, torch.zeros(2, 3, dtype=torch.bool))
    assert empty == {"reverse_kl": 0.0, "teacher_logprob": 0.0}


@pytest.mark.parametrize("loss", ["inline", "default", "gpg"])
def test_as_reward_gradient_is_coef_times_surrogate_gradient(loss):
    # A = coef (log q(y) - log p(y)) (detached); the policy loss at logp = logp_old: l = -A exp(logp - logp_old),
    # value -A, gradient -A grad log p = coef d grad log p: coef times the one-sample surrogate's, value
    # and gradient both (same token-mean aggregation). coef 0.5: value 0.5 ln(20/3) / 3 = 0.316187.
    coef = 0.5
    logits, logprobs, teacher, mask = onesample_case()
    advantages = distill_advantages(teacher, logprobs.detach(), mask, coef)
    assert not advantages.requires_grad
    old = logprobs.detach()
    if loss == "inline":
        ratio = torch.exp(zero_masked(logprobs, mask) - zero_masked(old, mask))
        value = aggregate_loss(-advantages * ratio, mask, "token")
    else:  # at ratio 1 no clip is active (default) / gpg: -A logp, the same gradient
        value, _ = get_policy_loss(loss)(policy_loss_inputs(
            logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, loss_avg_mode="token"))
    grad_z, grad_logp = torch.autograd.grad(value, [logits, logprobs], retain_graph=True)
    expected_z, expected_logp = hand_surrogate_grad()
    assert_close(grad_z, coef * torch.tensor(expected_z, dtype=F64))
    assert_close(grad_logp, coef * torch.tensor(expected_logp, dtype=F64))
    if loss != "gpg":  # gpg's value is -A logp, not -A
        assert_close(value, torch.tensor(coef * math.log(20 / 3) / 3, dtype=F64))
    # and equal to coef times what distill_loss's autograd gives
    (surrogate_z,) = torch.autograd.grad(distill_loss(logprobs, teacher, mask, "token"), logits)
    assert_close(grad_z, coef * surrogate_z)
