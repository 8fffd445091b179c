"""Clip-Cov and KL-Cov: policy losses that act on the tokens whose log-prob moves with the advantage.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617, sec. 5. The policy entropy falls fastest where the centred log-prob and the
centred advantage are large together; per valid token t of the micro-batch

    Cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))           (means over the valid tokens)

(the paper's token-wise centred cross-product, detached). Clip-Cov detaches the gradient of a few such tokens, KL-Cov puts a
penalty on them. verl's loss modes ``clip_cov`` / ``kl_cov`` (keys ``clip_cov_ratio``,
``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``, same defaults).

As in verl, the means and the token counts are those of the micro-batch the loss sees (on one
rank), so the selection depends on how a mini-batch is cut into micro-batches; the loss is then
aggregated with the mini-batch normaliser like every other loss. Departures from verl: padding
never enters the centring means (verl's ``masked_mean`` agrees); the metric ``pg_cov_frac`` (the
fraction of valid tokens selected) replaces verl's ``pg_clipfrac`` for Clip-Cov, and KL-Cov reports
``ppo_kl`` as the k1 mean like every loss here (verl reports mean |log r| under that name).
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.masked import masked_mean
from easyvlm.algorithms.policy_losses import (
    PolicyLossInputs,
    _base_metrics,
    _clip_metrics,
    _clipped_surrogate,
    _fraction,
    _prepare,
    register_policy_loss,
    weighted,
)


def token_covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) Cov_t = (A_t - mean A) (log pi_t - mean log pi), means over valid tokens; detached,
    0 at masked positions."""
    advantages, logprobs = advantages.detach(), logprobs.detach()
    centred = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask, centred, torch.zeros_like(centred))


def _selected_count(ratio: float, mask: Tensor) -> int:
    """max(int(ratio * valid tokens), 1): verl's count (at least one token per micro-batch)."""
    return max(int(ratio * int(mask.sum().item())), 1)


@register_policy_loss("clip_cov")
def clip_cov_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov, arXiv:2505.22617 sec. 5: PPO's clipped surrogate (clip-higher, no dual clip, as
    verl), and the gradient of k = max(int(clip_cov_ratio * N), 1) tokens drawn uniformly at random
    (torch's global generator) among the valid, not already clipped tokens with clip_cov_lb < Cov_t
    < clip_cov_ub is detached (their loss is multiplied by 0). N: the micro-batch's valid tokens.
    Metrics: ``pg_cov_frac`` (selected / N) and the PPO clip fractions.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    token_losses, clip_active = _clipped_surrogate(ratio, p.advantages, inputs)
    covariance = token_covariance(p.advantages, p.logprobs, p.mask)
    in_band = p.mask & ~clip_active & (covariance > inputs.clip_cov_lb) & (covariance < inputs.clip_cov_ub)
    candidates = torch.nonzero(in_band)  # (n, 2) row-major
    order = torch.randperm(len(candidates), device=candidates.device)
    chosen = candidates[order[: _selected_count(inputs.clip_cov_ratio, p.mask)]]
    keep = torch.ones_like(token_losses)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = aggregate_loss(weighted(token_losses * keep, inputs), p.mask, inputs.loss_avg_mode, inputs.normalizer)
    return loss, {"pg_cov_frac": _fraction(keep == 0, p.mask), **_clip_metrics(clip_active, p)}


@register_policy_loss("kl_cov")
def kl_cov_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov, arXiv:2505.22617 sec. 5: no clip; l_t = -A_t r_t, plus ppo_kl_coef * |log r_t| on the
    k = max(int(kl_cov_ratio * N), 1) valid tokens with the largest Cov_t (ties: torch.topk's order).
    N: the micro-batch's valid tokens. Metric ``pg_cov_frac``: k / N.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    token_losses = -p.advantages * ratio
    covariance = token_covariance(p.advantages, p.logprobs, p.mask)
    flat = torch.where(p.mask, covariance, torch.full_like(covariance, -torch.inf)).flatten()
    count = min(_selected_count(inputs.kl_cov_ratio, p.mask), int(p.mask.sum().item()))
    selected = torch.zeros_like(p.mask).flatten()
    selected[torch.topk(flat, count).indices] = True
    selected = selected.view_as(p.mask)
    token_losses = token_losses + inputs.ppo_kl_coef * p.log_ratio.abs() * selected
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.loss_avg_mode, inputs.normalizer)
    return loss, {"pg_cov_frac": _fraction(selected, p.mask), **_base_metrics(p)}
