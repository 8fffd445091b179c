"""Clipped value (critic) loss. PPO as implemented in OpenAI baselines; arXiv:1707.06347, eqn. 9 (L^VF).

v_clip = old_values + clip(values - old_values, -c, c);
l_t = 0.5 * max((values - returns)^2, (v_clip - returns)^2), aggregated like the policy loss.

Departure from the paper: the paper's L^VF is unclipped; the clipped form (pessimistic max) is the
one of OpenAI baselines' ppo2, which EasyR1/verl use (``worker.critic.cliprange_value``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.masked import check_mask, masked_mean, zero_masked


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_avg_mode: str = "token",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (0-d, with grad through ``values``) and metrics.

    values (with grad), old_values (critic values when the batch was collected), returns (GAE
    targets): (B, T) float. response_mask: (B, T) bool. cliprange_value: c >= 0.
    Metrics: ``vf_clipfrac`` (fraction of valid tokens where the clipped term is the larger),
    ``vpred_mean`` (mean value prediction).
    """
    check_mask(response_mask, values)
    if cliprange_value < 0:
        raise ValueError(f"worker.critic.cliprange_value must be >= 0, got {cliprange_value}")
    values = zero_masked(values, response_mask)
    old_values = zero_masked(old_values, response_mask)
    returns = zero_masked(returns, response_mask)
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    token_losses = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = aggregate_loss(token_losses, response_mask, loss_avg_mode, normalizer)
    metrics = {
        "vf_clipfrac": masked_mean((clipped_sq > unclipped_sq).to(torch.float32), response_mask).item(),
        "vpred_mean": masked_mean(values.detach(), response_mask).item(),
    }
    return loss, metrics
