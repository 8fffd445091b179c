"""The step level of GiGPO (Feng et al. 2025, arXiv:2505.10978; verl-agent): a multi-turn sample's
model turns are its steps; steps of different samples of one prompt that start from the same state
(the same anchor) form a step group, in which their discounted returns are compared.

Layout (easyvlm.agents.loop, environment runs): ``turn_index`` (B, T) int, the step of each response
token (-1 on observations and padding); ``step_rewards`` (B, S) float and ``step_anchors`` (B, S)
int, per step, 0 past a sample's steps. The functions here are pure; the estimator is
``gigpo_advantages`` in easyvlm.algorithms.advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def steps_taken(turn_index: Tensor, num_steps: int) -> Tensor:
    """(B, S) bool: the steps that have at least one response token (a step without tokens has
    nothing to train and joins no step group)."""
    taken = torch.zeros(turn_index.shape[0], num_steps, dtype=torch.bool, device=turn_index.device)
    rows, cols = torch.nonzero(turn_index >= 0, as_tuple=True)
    taken[rows, turn_index[rows, cols]] = True
    return taken


def step_returns(step_rewards: Tensor, gamma: float) -> Tensor:
    """(B, S) discounted return-to-go of each step: G_k = r_k + gamma * G_{k+1}. The rewards past a
    sample's last step are 0, so the recursion over every column is the sample's own."""
    returns = torch.zeros_like(step_rewards)
    running = step_rewards.new_zeros(step_rewards.shape[0])
    for k in reversed(range(step_rewards.shape[1])):
        running = step_rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns


def step_group_ids(group_ids: Tensor, step_anchors: Tensor, taken: Tensor) -> Tensor:
    """(N,) int64, N = taken.sum(): the step group of each taken step (row-major order), equal for
    steps of the same prompt group (``group_ids`` (B,)) that start from the same anchor."""
    prompt = group_ids.unsqueeze(1).expand_as(step_anchors)[taken]
    keys = torch.stack([prompt, step_anchors[taken]], dim=1)  # (N, 2)
    if keys.shape[0] == 0:
        return keys.new_zeros(0)
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def on_step_tokens(step_values: Tensor, turn_index: Tensor) -> Tensor:
    """(B, S) per step -> (B, T): each token gets its step's value, tokens of no step (-1) 0."""
    values = step_values.gather(1, turn_index.clamp(min=0))
    return torch.where(turn_index >= 0, values, 0.0)


def step_group_metrics(group_ids: Tensor, step_anchors: Tensor, turn_index: Tensor) -> dict[str, float]:
    """``gigpo/step_group_size_{mean,max}``: steps per step group; ``gigpo/grouped_step_fraction``:
    the share of steps in a group of two or more (the others get no step advantage)."""
    taken = steps_taken(turn_index, step_anchors.shape[1])
    ids = step_group_ids(group_ids, step_anchors, taken)
    if ids.numel() == 0:
        return {}
    sizes = torch.bincount(ids).float()
    return {
        "gigpo/step_group_size_mean": float(sizes.mean()),
        "gigpo/step_group_size_max": float(sizes.max()),
        "gigpo/grouped_step_fraction": int((sizes[ids] > 1).sum()) / ids.numel(),
    }
