"""Several reward functions, normalised one by one before their weighted sum (GDPO).

``algorithm.multi_objective_aggregation=normalize_then_sum``. GDPO, Liu et al., "GDPO: Group
reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
arXiv:2601.05242 (the GDPO advantage of its method section); TRL's
``GRPOConfig.multi_objective_aggregation="normalize_then_sum"`` (trl/trainer/grpo_trainer.py,
``_generate_and_score_completions``). With r_ik the score of reward function k for sample i and
g(i) the group (prompt) of sample i:

    rhat_ik = (r_ik - mean_{g(i)} r_k) / (std_{g(i)} r_k + eps)     per group and function
    R_i     = sum_k w_k rhat_ik                                      weighted sum
    A_i     = (R_i - mean_batch R) / (std_batch R + eps)             batch normalisation

eps = 1e-4 and both stds unbiased (Bessel's correction), as TRL. Summing first
(``sum_then_normalize``, GRPO's way) lets different reward combinations fall on the same
advantage (GDPO's "reward collapse"); normalising each function first keeps them apart.

Where this differs:
- easyvlm's ``grpo`` estimator uses the same unbiased std but eps = 1e-6 (``AdvantageInputs.eps``);
  these functions use TRL's 1e-4 at both stages.
- TRL scores missing rewards (None) as NaN and skips them (nanmean, nanstd); easyvlm reward
  functions always return a float (``on_error=zero`` scores a failure 0), so there is no NaN here.
- TRL's groups are consecutive blocks of ``num_generations``; here ``group_ids`` may come in any
  order and sizes. A group of one gets rhat = 0 (its mean is itself, its std 0), as TRL's
  ``num_generations=1``; a batch of one gets A = 0.
- The paper's sum is unweighted (w_k = 1); the weights are TRL's (``reward_weights``), here
  ``worker.reward.reward_functions[k].weight``.
- The batch is the driver's whole step (every rank's samples), as TRL's gathered batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from easyvlm.algorithms.advantages import AdvantageInputs, AdvantageOutputs, group_stats, seq_rewards_of
from easyvlm.algorithms.masked import zero_masked

MULTI_OBJECTIVE_EPS = 1e-4
"""TRL's epsilon, at both stages."""


@torch.no_grad()
def normalize_then_sum(scores: Tensor, weights: Sequence[float] | Tensor, group_ids: Tensor,
                       eps: float = MULTI_OBJECTIVE_EPS) -> Tensor:
    """R_i = sum_k w_k (r_ik - mean_g r_k) / (std_g r_k + eps): each function's score normalised
    within its group (unbiased std), then weighted and summed. GDPO, arXiv:2601.05242.

    scores: (B, K) float, column k the k-th reward function's own ``overall``. weights: (K,).
    group_ids: (B,) int, samples of one prompt share an id. Returns (B,) float.
    """
    weights = torch.as_tensor(weights, dtype=scores.dtype, device=scores.device)
    if scores.dim() != 2 or weights.shape != (scores.shape[1],) or group_ids.shape != (scores.shape[0],):
        raise ValueError(f"scores must be (B, K) with weights (K,) and group_ids (B,), got {tuple(scores.shape)}, "
                         f"{tuple(weights.shape)}, {tuple(group_ids.shape)}")
    total = scores.new_zeros(scores.shape[0])
    for k in range(scores.shape[1]):
        mean, std, _ = group_stats(scores[:, k], group_ids)
        total = total + weights[k] * (scores[:, k] - mean) / (std + eps)
    return total


@torch.no_grad()
def batch_normalize(values: Tensor, eps: float = MULTI_OBJECTIVE_EPS) -> Tensor:
    """(v - mean(v)) / (std(v) + eps) over the whole (B,) batch, unbiased std; 0 for a batch of one."""
    if values.numel() < 2:
        return torch.zeros_like(values)
    return (values - values.mean()) / (values.std() + eps)


@torch.no_grad()
def gdpo_scores(scores: Tensor, weights: Sequence[float] | Tensor, group_ids: Tensor,
                eps: float = MULTI_OBJECTIVE_EPS) -> Tensor:
    """A_i = batch_normalize(normalize_then_sum(scores)): GDPO's per-sample advantage, (B,)."""
    return batch_normalize(normalize_then_sum(scores, weights, group_ids, eps), eps)


@torch.no_grad()
def gdpo_advantages(scores: Tensor, weights: Sequence[float] | Tensor, group_ids: Tensor, response_mask: Tensor,
                    eps: float = MULTI_OBJECTIVE_EPS) -> AdvantageOutputs:
    """GDPO's A_i (see :func:`gdpo_scores`) on every valid response token, 0 elsewhere; returns =
    advantages. response_mask: (B, T) bool."""
    if response_mask.dtype != torch.bool or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask must be a bool (B, T) tensor with B = {scores.shape[0]}, got "
                         f"{response_mask.dtype} {tuple(response_mask.shape)}")
    seq = gdpo_scores(scores, weights, group_ids, eps)
    advantages = zero_masked(seq.unsqueeze(-1).expand(response_mask.shape), response_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


@torch.no_grad()
def score_as_advantage(inputs: AdvantageInputs) -> AdvantageOutputs:
    """The sequence score (the sum of the token rewards) as the advantage of every valid token.

    What ``grpo`` becomes with ``normalize_then_sum``: the trainer places GDPO's A_i as the
    sequence score, which is already group-relative and normalised (GRPO's own normalisation of it
    would undo GDPO's batch normalisation), so this gives :func:`gdpo_advantages`.
    """
    seq = seq_rewards_of(inputs)
    advantages = zero_masked(seq.unsqueeze(-1).expand(inputs.response_mask.shape), inputs.response_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)
