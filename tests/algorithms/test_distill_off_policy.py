"""On-policy distillation's one-sample loss on off-policy tokens (easyvlm.algorithms.distill
``off_policy_weights``, and ``kl.kl_full_shared_rows`` for teachers with padded output layers):
hand-derived values and gradients, in float64 unless said otherwise.

The weighted surrogate per token has value w d and gradient w d grad log pi_s, with
d = log pi_s(y) - log pi_T(y) and w = min(pi_s(y) / pi_b(y), u) detached; so with the student's
log-probs as the leaf, d(token mean)/d log pi_s(y_t) = w_t d_t / N.
"""

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask
from torch.testing import assert_close

from easyvlm.algorithms.distill import distill_loss, off_policy_weights
from easyvlm.algorithms.kl import kl_full, kl_full_shared_rows

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2)

# ----------------------------------------------------------------------------- the 2 x 3 example
# lengths (3, 2): (1, 2) is padding (NaN in every input); u = 2 (rollout_is_threshold's default).
# Per token: the student's log-prob s, log pi_s - log pi_b, the teacher's log-prob q:
#   (0, 0): s = -1.0,  s - b = 0      -> w = 1;               q = -2.0  -> d =  1.0,  w d =  1.0
#   (0, 1): s = -0.5,  s - b = ln 4   -> 4, truncated: w = 2; q = -1.5  -> d =  1.0,  w d =  2.0
#   (0, 2): s = -2.0,  s - b = -ln 2  -> w = 0.5;             q = -1.0  -> d = -1.0,  w d = -0.5
#   (1, 0): s = -0.25, s - b = ln 1.5 -> w = 1.5;             q = -0.75 -> d =  0.5,  w d =  0.75
#   (1, 1): s = -3.0,  s - b = 0      -> w = 1;               q = -1.0  -> d = -2.0,  w d = -2.0
# Token mean over the N = 5 valid tokens: (1 + 2 - 0.5 + 0.75 - 2) / 5 = 1.25 / 5 = 0.25
# (unweighted: (1 + 1 - 1 + 0.5 - 2) / 5 = -0.1). Gradient w.r.t. s: w d / 5 =
#   [[0.2, 0.4, -0.1], [0.15, -0.4, 0]]  (0 at padding).
STUDENT = [[-1.0, -0.5, -2.0], [-0.25, -3.0, NAN]]
LOG_RATIO = [[0.0, math.log(4), -LN2], [math.log(1.5), 0.0, NAN]]
TEACHER = [[-2.0, -1.5, -1.0], [-0.75, -1.0, NAN]]
CAP = 2.0


def case():
    student = torch.tensor(STUDENT, dtype=F64, requires_grad=True)
    behaviour = student.detach() - torch.tensor(LOG_RATIO, dtype=F64)
    return student, behaviour, torch.tensor(TEACHER, dtype=F64), lengths_to_mask([3, 2], 3)


def test_weights_of_the_example():
    student, behaviour, _, mask = case()
    weights = off_policy_weights(student, behaviour, CAP)
    assert not weights.requires_grad
    assert_close(weights[mask], torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0], dtype=F64))


def test_weighted_loss_value_and_gradient():
    student, behaviour, teacher, mask = case()
    weights = off_policy_weights(student, behaviour, CAP)
    loss = distill_loss(student, teacher, mask, "token", weights=weights)
    assert_close(loss, torch.tensor(0.25, dtype=F64))
    (grad,) = torch.autograd.grad(loss, student)
    # NaN at the padding reaches neither the value nor the gradient
    assert_close(grad, torch.tensor([[0.2, 0.4, -0.1], [0.15, -0.4, 0.0]], dtype=F64))
    # the unweighted loss of the same tokens, for contrast: (1 + 1 - 1 + 0.5 - 2) / 5
    assert_close(distill_loss(student, teacher, mask, "token"), torch.tensor(-0.1, dtype=F64))


def test_weighted_gradient_through_the_logits():
    # the weight scales the score-function gradient: d/dz = w d (onehot(y) - p) / N. One token
    # (N = 1), p = (0.5, 0.25, 0.25), y = 0, q(y) = 0.25 -> d = ln 2; pi_b(y) = 0.25 -> w = 0.5 / 0.25 = 2,
    # truncated at u = 1.5: gradient 1.5 ln2 (0.5, -0.25, -0.25) = (0.519860, -0.259930, -0.259930)
    logits = torch.tensor([0.5, 0.25, 0.25], dtype=F64).log().requires_grad_()
    logprob = torch.log_softmax(logits, -1)[0].view(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    weights = off_policy_weights(logprob, torch.tensor([[math.log(0.25)]], dtype=F64), 1.5)
    loss = distill_loss(logprob, torch.tensor([[math.log(0.25)]], dtype=F64), mask, "token", weights=weights)
    assert_close(loss, torch.tensor(1.5 * LN2, dtype=F64))
    (grad,) = torch.autograd.grad(loss, logits)
    assert_close(grad, torch.tensor([0.519860, -0.259930, -0.259930], dtype=F64), atol=1e-6, rtol=0)


def test_weights_are_truncated_from_above_only():
    # log ratios ln 4, ln 2, 0, -ln 2, 30, -30: raw weights 4, 2, 1, 0.5, e^30, e^-30; the log is
    # clamped to [-20, 20] (the rollout correction's convention), then min(w, u)
    log_ratio = torch.tensor([[math.log(4), LN2, 0.0, -LN2, 30.0, -30.0]], dtype=F64)
    current = torch.full_like(log_ratio, -1.0)
    behaviour = current - log_ratio
    assert_close(off_policy_weights(current, behaviour, 2.0),
                 torch.tensor([[2.0, 2.0, 1.0, 0.5, 2.0, math.exp(-20.0)]], dtype=F64))
    assert_close(off_policy_weights(current, behaviour, 3.0),
                 torch.tensor([[3.0, 2.0, 1.0, 0.5, 3.0, math.exp(-20.0)]], dtype=F64))


@pytest.mark.parametrize("mode", ["token", "seq", "seq-mean-token-sum"])
def test_on_policy_weights_are_one_and_the_loss_is_bit_identical(mode):
    # behaviour = the current student (the actor's on-policy update, old log-probs = its own pass,
    # detached): w = exp(0) = 1 exactly, so value and gradient equal the unweighted loss's bit for
    # bit, in float32 as the actor computes them
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen).requires_grad_()
    tokens = torch.randint(0, 5, (2, 3), generator=gen)
    mask = lengths_to_mask([3, 2], 3)
    teacher = torch.log_softmax(torch.randn(2, 3, 5, generator=gen), -1).gather(-1, tokens[..., None])[..., 0]

    def loss_and_grad(weighted: bool):
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
        weights = off_policy_weights(logprobs, logprobs.detach(), CAP) if weighted else None
        if weighted:
            assert torch.equal(weights, torch.ones_like(weights))
        loss = distill_loss(logprobs, teacher, mask, mode, normalizer=None, weights=weights)
        return loss, torch.autograd.grad(loss, logits)[0]

    (plain, plain_grad), (weighted, weighted_grad) = loss_and_grad(False), loss_and_grad(True)
    assert plain.item() != 0.0 and plain_grad.abs().max() > 0
    assert torch.equal(plain, weighted) and torch.equal(plain_grad, weighted_grad)


# ----------------------------------------------------------------------------- padded vocabularies
# One position. The student over V = 3 ids: p = (0.5, 0.25, 0.25). The teacher's output layer has 5
# rows for the same 3 tokens; its padding rows 3, 4 are blocked (-inf): q = (0.25, 0.5, 0.25, 0, 0).
# Over the shared rows KL(p || q) = 0.5 ln 2 + 0.25 ln(1/2) + 0 = 0.25 ln 2 = 0.173287, the value of
# kl_full on the two 3-row distributions.
# Where the teacher's padding rows are not blocked, q' = (0.2, 0.4, 0.2, 0.1, 0.1): renormalised over
# the shared rows it is (0.25, 0.5, 0.25), the same KL: only the tokens' distributions are compared.
P3 = [0.5, 0.25, 0.25]
Q3 = [0.25, 0.5, 0.25]


def as_log(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64).log().view(1, 1, -1)  # log 0 = -inf: a blocked row


@pytest.mark.parametrize("teacher", [[0.25, 0.5, 0.25, 0.0, 0.0], [0.2, 0.4, 0.2, 0.1, 0.1]])
def test_full_kl_over_padded_vocabularies_is_the_kl_over_the_shared_rows(teacher):
    expected = torch.tensor([[0.25 * LN2]], dtype=F64)
    assert expected.item() == pytest.approx(0.173287, abs=1e-6)
    assert_close(kl_full(as_log(P3), as_log(Q3)), expected)  # the 3-row KL itself
    assert_close(kl_full_shared_rows(as_log(P3), as_log(teacher)), expected)
    # either side may be the wider one: the student padded (rows 3, 4 blocked) against a 3-row teacher
    assert_close(kl_full_shared_rows(as_log([*P3, 0.0, 0.0]), as_log(Q3)), expected)


def test_full_kl_over_padded_rows_keeps_the_students_gradient():
    # d KL / d z_j = p_j (log p_j - log q_j - KL) (tests/algorithms/test_distill_loss.py):
    # (0.375, -0.3125, -0.0625) ln 2 on the student's 3 logits, whatever the teacher's padding
    logits = torch.tensor(P3, dtype=F64).log().requires_grad_()
    kl = kl_full_shared_rows(torch.log_softmax(logits, -1).view(1, 1, 3), as_log([0.25, 0.5, 0.25, 0.0, 0.0]))
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    assert_close(grad, torch.tensor([0.375, -0.3125, -0.0625], dtype=F64) * LN2)


def test_equal_widths_are_kl_full_itself():
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.log_softmax(torch.randn(2, 3, 7, generator=gen), -1) for _ in range(2))
    assert torch.equal(kl_full_shared_rows(a, b), kl_full(a, b))
