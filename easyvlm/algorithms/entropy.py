"""Token entropy of the policy, and the entropy bonus loss term.

H_t = -sum_v p(v) log p(v) with log p = log_softmax(logits) (stable for large logits). Entries with
p = 0 (e.g. -inf logits of masked vocabulary) contribute exactly 0, with a finite gradient, where
the textbook formula gives 0 * -inf = NaN.

Entropy regularisation as in PPO, arXiv:1707.06347 eqn. 9 (the ``c2 S[pi]`` term).
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. (B, T, V) -> (B, T), in float32 at least.

    Differentiable. Memory: one extra (B, T, V) float32 tensor; call it per micro-batch.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)
    # where p == 0, logp is -inf: replace it before the product (0 * -inf = NaN)
    safe_logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(logp.exp() * safe_logp).sum(-1)


def entropy_bonus_loss(
    entropy: Tensor,
    response_mask: Tensor,
    entropy_coeff: float,
    loss_avg_mode: str = "token",
    normalizer: float | None = None,
) -> Tensor:
    """The term to ADD to the actor loss: ``-entropy_coeff * aggregate(entropy)`` (0-d).

    entropy: (B, T) from :func:`entropy_from_logits` (with grad). response_mask: (B, T) bool.
    Same ``loss_avg_mode`` / ``normalizer`` as the policy loss. A positive coefficient rewards
    entropy (``worker.actor.entropy_coeff``).
    """
    return -entropy_coeff * aggregate_loss(entropy, response_mask, loss_avg_mode, normalizer)
