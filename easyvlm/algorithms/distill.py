"""On-policy distillation (GKD, Agarwal et al., arXiv:2306.13649): the student samples, a teacher
scores the student's own tokens, and the student moves towards the teacher by the reverse KL

    KL(pi_s || pi_T) at position t = sum_v pi_s(v | x, y_<t) (log pi_s(v | ...) - log pi_T(v | ...)),

the mode-seeking direction: the student is penalised for putting mass where the teacher puts
little, on the prefixes it actually produces (so it learns to recover from its own mistakes, which
distillation on the teacher's samples never shows it). Per token, as GKD and the Qwen3 / Thinking
Machines recipes use it: the effect of a token on the later positions' KL is not counted.

Three forms (``algorithm.distill_*``; docs/algorithms.md compares them with verl's and TRL's):

- one-sample (default): with d_t = log pi_s(y_t) - log pi_T(y_t) of the sampled token y_t ~ pi_s,
  E[d_t] is the KL at t. As a loss, d_t itself has the useless gradient grad log pi_s(y_t) (zero in
  expectation); :func:`reverse_kl_surrogate` has value d_t and gradient d_t grad log pi_s(y_t), whose
  expectation under pi_s is the KL's gradient (the score-function identity; the same gradient as
  k2 = d_t^2 / 2, see "On a few pitfalls in KL divergence gradient estimation for RL",
  arXiv:2506.09477);
- full (``distill_full_kl``): the exact KL over the vocabulary (``kl.kl_full``), differentiated as is;
- as reward (``distill_as_reward``): :func:`distill_advantages`, the teacher's log-prob advantage
  -d_t as each token's advantage, optimised by the policy loss (the ratio's gradient at the sampling
  weights is again d_t grad log pi_s, with the sign of a loss to minimise).

Off-policy samples. The one-sample form is unbiased only for tokens drawn from the current student.
After the first of several mini-batches or epochs the tokens come from a behaviour policy pi_b (the
weights before the update); :func:`off_policy_weights` gives the importance weight that restores the
expectation, E_{y~pi_b}[w d grad log pi_s] = E_{y~pi_s}[d grad log pi_s] with w = pi_s(y) / pi_b(y).
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.masked import check_mask, masked_mean, zero_masked
from easyvlm.algorithms.rollout_correction import SAFETY_BOUND


def reverse_kl_surrogate(logprobs: Tensor, teacher_logprobs: Tensor, weights: Tensor | None = None) -> Tensor:
    """(B, T) per-token one-sample reverse KL: value d = log pi_s - log pi_T (the estimate), gradient
    d * grad log pi_s (the estimate of the KL's gradient). ``logprobs`` carries the gradient.
    ``weights`` (detached, :func:`off_policy_weights`): value w d, gradient w d grad log pi_s."""
    d = (logprobs - teacher_logprobs).detach()
    if weights is not None:
        d = d * weights.detach()
    return d * (1.0 + logprobs - logprobs.detach())


def off_policy_weights(logprobs: Tensor, behaviour_logprobs: Tensor, upper: float) -> Tensor:
    """(B, T) detached importance weights w = min(pi_s(y) / pi_b(y), upper) of the sampled tokens.

    The one-sample loss's gradient d grad log pi_s estimates the reverse KL's gradient only for
    y ~ pi_s; for y drawn from a behaviour policy pi_b (the student before the update, once an earlier
    mini-batch or epoch has moved it; or a stale sampler) the estimator

        w d grad log pi_s,   w = exp(log pi_s(y) - log pi_b(y)),

    has the same expectation, sum_y pi_b(y) (pi_s(y) / pi_b(y)) d_y grad log pi_s(y). The weight is
    truncated from above at ``upper`` as the rollout correction's truncated IS does (the log clamped
    to [-20, 20] first; ``rollout_correction.importance_weights``): a little bias for a bounded
    variance. When pi_b is the current student, log pi_s - log pi_b = 0 and w = 1 exactly
    (with upper >= 1), so the weighted loss equals the unweighted one bit for bit."""
    log_ratio = (logprobs.detach() - behaviour_logprobs.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(log_ratio).clamp(max=upper)


def distill_loss(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    response_mask: Tensor,
    loss_avg_mode: str = "token",
    normalizer: float | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """The one-sample distillation loss, aggregated like the policy loss (0-d, with grad).
    logprobs (with grad), teacher_logprobs: (B, T); response_mask: (B, T) bool; weights: None or the
    (B, T) off-policy importance weights (:func:`off_policy_weights`)."""
    check_mask(response_mask, logprobs)
    # padding may hold garbage (even NaN): keep it out of the value and the gradient
    per_token = reverse_kl_surrogate(zero_masked(logprobs, response_mask), zero_masked(teacher_logprobs, response_mask),
                                     None if weights is None else zero_masked(weights, response_mask))
    return aggregate_loss(per_token, response_mask, loss_avg_mode, normalizer)


def distill_advantages(teacher_logprobs: Tensor, logprobs: Tensor, response_mask: Tensor, coef: float) -> Tensor:
    """(B, T) the teacher's log-prob advantage coef * (log pi_T - log pi_s) of each sampled token, no
    baseline; 0 at padding. ``logprobs``: the student's before the update (old log-probs)."""
    check_mask(response_mask, logprobs)
    return zero_masked(coef * (teacher_logprobs - logprobs), response_mask)


def distill_metrics(reverse_kl: Tensor, teacher_logprobs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """``reverse_kl`` (the per-token KL or its one-sample estimate) and ``teacher_logprob``, token means."""
    return {"reverse_kl": float(masked_mean(reverse_kl.detach(), response_mask)),
            "teacher_logprob": float(masked_mean(teacher_logprobs.detach(), response_mask))}
