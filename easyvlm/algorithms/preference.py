"""The Bradley-Terry loss of reward-model training (Ouyang et al. 2022, arXiv:2203.02155, eqn. 1).

P(chosen preferred over rejected) = sigmoid(r_c - r_r), so the negative log-likelihood of a pair is

    l = -log sigmoid(r_c - r_r - m) = softplus(-(r_c - r_r - m))

with an optional margin m >= 0 per pair (Llama 2, arXiv:2307.09288, section 3.2.2: the chosen reward
must exceed the rejected one by m before the pair stops pulling). softplus is the stable form of
-log sigmoid: for a large negative difference it is the difference itself, never log(0).

Gradient (checked by hand in tests/algorithms/test_preference.py): with d = r_c - r_r - m,
dl/dr_c = -sigmoid(-d), dl/dr_r = +sigmoid(-d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | None = None, normalizer: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Sum of the pairs' losses divided by ``normalizer`` (default: the number of pairs: the mean).

    chosen_scores, rejected_scores: (N,) scalar rewards (with grad). margin: (N,) or None (= 0).
    ``normalizer``: the pairs of the whole optimizer step, so that micro-batches add up to the
    step's mean whatever their sizes. Metrics (sums over these pairs, to be divided by the step's
    pair count by the caller): ``correct`` (pairs with r_c > r_r; ties count as wrong), ``margin``
    (sum of r_c - r_r).
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(f"chosen and rejected scores must both be (N,), got {tuple(chosen_scores.shape)} "
                         f"and {tuple(rejected_scores.shape)}")
    diff = chosen_scores.float() - rejected_scores.float()
    shifted = diff if margin is None else diff - margin.to(diff)
    losses = F.softplus(-shifted)  # -log sigmoid(shifted)
    n = float(diff.numel()) if normalizer is None else float(normalizer)
    loss = losses.sum() / n
    with torch.no_grad():
        metrics = {"correct": float((diff > 0).sum()), "margin": float(diff.sum())}
    return loss, metrics
