"""Advantage estimators ``AdvantageInputs -> AdvantageOutputs`` by name (``algorithm.adv_estimator``): (B, T), 0 at
masked positions; a group of one is its own baseline (no signal). Formulas and departures: docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask, masked_sum, masked_whiten, zero_masked
from easyvlm.algorithms.registry import Registry
from easyvlm.algorithms.step_groups import on_step_tokens, step_group_ids, step_returns, steps_taken


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read (shapes checked, ValueError); an estimator ignores what it does not use."""

    token_rewards: Tensor
    """(B, T): the sequence reward at the last valid token, plus per-token KL penalties if KL-in-reward."""
    response_mask: Tensor
    group_ids: Tensor
    """(B,) int: samples with the same id answer the same prompt."""
    values: Tensor | None = None
    """(B, T) critic values V(s_t) (gae only)."""
    baseline_rewards: Tensor | None = None
    """(B,) reward of the greedy response to the same prompt (remax only)."""
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    eps: float = 1e-6
    """Added to the group std before dividing (grpo, grpo_passk, gigpo)."""
    norm_by_std: bool = True
    """grpo / grpo_passk / gigpo: divide by the group std; False = Dr. GRPO (arXiv:2503.20783)."""
    turn_index: Tensor | None = None
    """(B, T) int: each response token's step (model turn), -1 elsewhere (gigpo only)."""
    step_rewards: Tensor | None = None
    """(B, S) each step's environment reward, 0 past a sample's steps (gigpo only)."""
    step_anchors: Tensor | None = None
    """(B, S) int: the identity of the state each step started from (gigpo only)."""

    def __post_init__(self) -> None:
        if self.token_rewards.dim() != 2:
            raise ValueError(f"token_rewards must be (B, T), got shape {tuple(self.token_rewards.shape)}")
        check_mask(self.response_mask, self.token_rewards)
        if self.response_mask.shape != self.token_rewards.shape:
            raise ValueError(
                f"response_mask {tuple(self.response_mask.shape)} != token_rewards {tuple(self.token_rewards.shape)}"
            )
        batch_size = self.token_rewards.shape[0]
        if self.group_ids.shape != (batch_size,) or self.group_ids.dtype.is_floating_point:
            raise ValueError(
                f"group_ids must be an integer tensor of shape ({batch_size},), got "
                f"{self.group_ids.dtype} {tuple(self.group_ids.shape)}"
            )
        if self.values is not None and self.values.shape != self.token_rewards.shape:
            raise ValueError(f"values {tuple(self.values.shape)} != token_rewards {tuple(self.token_rewards.shape)}")
        if self.baseline_rewards is not None and self.baseline_rewards.shape != (batch_size,):
            raise ValueError(f"baseline_rewards must be ({batch_size},), got {tuple(self.baseline_rewards.shape)}")
        self._check_steps()

    def _check_steps(self) -> None:
        steps = (self.turn_index, self.step_rewards, self.step_anchors)
        if all(x is None for x in steps):
            return
        if any(x is None for x in steps):
            raise ValueError("turn_index, step_rewards and step_anchors come together (or none of them)")
        B, S = self.token_rewards.shape[0], self.step_rewards.shape[-1]
        if self.turn_index.shape != self.token_rewards.shape:
            raise ValueError(f"turn_index {tuple(self.turn_index.shape)} != token_rewards {tuple(self.token_rewards.shape)}")
        if self.step_rewards.shape != (B, S) or self.step_anchors.shape != (B, S):
            raise ValueError(f"step_rewards {tuple(self.step_rewards.shape)} and step_anchors "
                             f"{tuple(self.step_anchors.shape)} must both be (B, S) with B = {B}")
        if self.turn_index.numel() and int(self.turn_index.max()) >= S:
            raise ValueError(f"turn_index names step {int(self.turn_index.max())}, but there are {S} step columns")


@dataclass(frozen=True)
class AdvantageOutputs:
    advantages: Tensor
    returns: Tensor
    """Value targets for the critic (gae)."""


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.adv_estimator")
register_advantage = ADVANTAGES.register


def advantage_names() -> tuple[str, ...]:
    return ADVANTAGES.names()


def get_advantage(name_or_spec: str) -> AdvantageFn:
    """The estimator of a registered name or a ``file.py:func`` plug-in (output checked: (B, T) AdvantageOutputs)."""
    fn, is_plugin = ADVANTAGES.get(name_or_spec)
    if not is_plugin:
        return fn

    def checked(inputs: AdvantageInputs) -> AdvantageOutputs:
        out = fn(inputs)
        if not isinstance(out, AdvantageOutputs):
            raise TypeError(
                f"advantage estimator {name_or_spec} returned {type(out).__name__}; it must return "
                "easyvlm.algorithms.AdvantageOutputs(advantages=(B, T) tensor, returns=(B, T) tensor)"
            )
        for field in ("advantages", "returns"):
            value = getattr(out, field)
            if not isinstance(value, Tensor) or value.shape != inputs.token_rewards.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"advantage estimator {name_or_spec}: {field} has shape {shape}, "
                    f"expected {tuple(inputs.token_rewards.shape)} (B, T)"
                )
        return out

    return checked


# ----------------------------------------------------------------------------- helpers


def seq_rewards_of(inputs: AdvantageInputs) -> Tensor:
    """(B,) sum of the token rewards over valid positions."""
    return masked_sum(inputs.token_rewards, inputs.response_mask, dim=-1)


def group_stats(seq_values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each sample's group mean, std (Bessel-corrected, 0 for a group of one) and size, of (B,) values: three (B,)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) group index 0..n_groups-1
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = seq_values.new_zeros(n_groups)
    count = zeros.index_add(0, inverse, torch.ones_like(seq_values))
    mean = zeros.index_add(0, inverse, seq_values) / count
    # two passes (subtract the mean first) for accuracy
    sq_dev = zeros.index_add(0, inverse, (seq_values - mean[inverse]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def own_groups(group_ids: Tensor, alone: Tensor) -> Tensor:
    """(B,) group ids in which each sample where the (B,) bool ``alone`` holds is a group of its own (an
    id no other sample has) and the others keep theirs: a sample that is not an answer of the policy
    (its environment failed) then takes no part in its group's mean, std or count."""
    if not bool(alone.any()):
        return group_ids
    fresh = group_ids.max() + 1 + torch.arange(group_ids.numel(), device=group_ids.device)
    return torch.where(alone, fresh.to(group_ids.dtype), group_ids)


def _broadcast(seq_advantages: Tensor, mask: Tensor) -> Tensor:
    return zero_masked(seq_advantages.unsqueeze(-1).expand(mask.shape), mask)


def _outcome(seq_advantages: Tensor, mask: Tensor) -> AdvantageOutputs:
    advantages = _broadcast(seq_advantages, mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """(B, T) G_t = r_t + gamma G_{t'}, t' the next valid position; masked positions are skipped (0)."""
    rewards = zero_masked(token_rewards, response_mask)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(response_mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return zero_masked(returns, response_mask)


# ----------------------------------------------------------------------------- estimators


def group_normalised(values: Tensor, group_ids: Tensor, norm_by_std: bool, eps: float) -> Tensor:
    """(values - group mean) [/ (group std + eps)]: GRPO's normalisation of (N,) values, 0 for a group of one."""
    mean, std, _ = group_stats(values, group_ids)
    centred = values - mean  # exactly 0 for a group of one (its mean is itself)
    return centred / (std + eps) if norm_by_std else centred


@register_advantage("gae")
@torch.no_grad()
def gae_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GAE (arXiv:1506.02438 eqn. 16): A_t = delta_t + gamma lam A_{t+1}, V = 0 past the last valid token;
    returns = A + V, then A is whitened over the batch's valid tokens. Needs ``values``."""
    if inputs.values is None:
        raise ValueError("adv_estimator 'gae' needs critic values (AdvantageInputs.values); is the critic enabled?")
    mask = inputs.response_mask
    rewards = zero_masked(inputs.token_rewards, mask)
    values = zero_masked(inputs.values, mask)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])  # (B,) V of the next valid token
    next_advantage = rewards.new_zeros(rewards.shape[0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        advantage = delta + inputs.gamma * inputs.lam * next_advantage
        valid = mask[:, t]
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = zero_masked(advantages + values, mask)
    return AdvantageOutputs(advantages=masked_whiten(advantages, mask), returns=returns)


@register_advantage("grpo")
@torch.no_grad()
def grpo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO (arXiv:2402.03300): A_i = (r_i - mean_g r) / (std_g r + eps); Dr. GRPO (no std) without ``norm_by_std``."""
    rewards = seq_rewards_of(inputs)  # (B,)
    mean, std, _ = group_stats(rewards, inputs.group_ids)
    seq_advantages = rewards - mean  # exactly 0 for a group of one (its mean is itself)
    if inputs.norm_by_std:
        seq_advantages = seq_advantages / (std + inputs.eps)
    return _outcome(seq_advantages, inputs.response_mask)


@register_advantage("rloo")
@torch.no_grad()
def rloo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """RLOO (arXiv:2402.14740): A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_g r)."""
    rewards = seq_rewards_of(inputs)
    mean, _, count = group_stats(rewards, inputs.group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), 0.0)
    return _outcome(scale * (rewards - mean), inputs.response_mask)


@register_advantage("grpo_passk")
@torch.no_grad()
def grpo_passk_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Pass@k, k = G (arXiv:2503.19595): A_i = max_j r_j - max_{j != i} r_j, over (std_g r + eps) if ``norm_by_std``."""
    rewards = seq_rewards_of(inputs)  # (B,)
    _, inverse = torch.unique(inputs.group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    neg_inf = rewards.new_full((n_groups,), float("-inf"))
    group_max = neg_inf.scatter_reduce(0, inverse, rewards, reduce="amax")[inverse]  # (B,)
    is_max = rewards == group_max
    n_at_max = torch.zeros_like(neg_inf).index_add(0, inverse, is_max.to(rewards.dtype))[inverse]
    below_max = torch.where(is_max, float("-inf"), rewards)
    second_max = neg_inf.scatter_reduce(0, inverse, below_max, reduce="amax")[inverse]
    unique_best = is_max & (n_at_max == 1)
    max_without_i = torch.where(unique_best, second_max, group_max)
    _, std, count = group_stats(rewards, inputs.group_ids)
    seq_advantages = torch.where(count > 1, group_max - max_without_i, 0.0)  # singleton: -inf baseline -> 0
    if inputs.norm_by_std:
        seq_advantages = seq_advantages / (std + inputs.eps)
    return _outcome(seq_advantages, inputs.response_mask)


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ (arXiv:2501.03262): returns G_t = sum_{s >= t} gamma^(s-t) r_s, advantages G whitened."""
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, inputs.gamma)
    return AdvantageOutputs(advantages=masked_whiten(returns, inputs.response_mask), returns=returns)


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline (arXiv:2501.03262): r_i - mean_g r, whitened; returns = advantages."""
    rewards = seq_rewards_of(inputs)
    mean, _, _ = group_stats(rewards, inputs.group_ids)
    centred = _broadcast(rewards - mean, inputs.response_mask)
    advantages = masked_whiten(centred, inputs.response_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


@register_advantage("remax")
@torch.no_grad()
def remax_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """ReMax (arXiv:2310.10505): A_i = r_i - ``baseline_rewards``_i (greedy); returns = rewards-to-go."""
    if inputs.baseline_rewards is None:
        raise ValueError("adv_estimator 'remax' needs baseline_rewards (B,): the rewards of greedy responses")
    seq_advantages = seq_rewards_of(inputs) - inputs.baseline_rewards
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, gamma=1.0)
    return AdvantageOutputs(advantages=_broadcast(seq_advantages, inputs.response_mask), returns=returns)


@register_advantage("gpg")
@torch.no_grad()
def gpg_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GPG (arXiv:2504.02546): A_i = (r_i - mean_g r) B / (B - M), M the samples of one-reward groups (0).
    verl counts differently: docs/algorithms.md, "GPG"."""
    rewards = seq_rewards_of(inputs)  # (B,)
    mean, std, _ = group_stats(rewards, inputs.group_ids)
    valid = std > 0  # a group of one has std 0
    alpha = rewards.numel() / max(int(valid.sum().item()), 1)
    return _outcome(alpha * (rewards - mean) * valid, inputs.response_mask)


# GiGPO's weight of the step advantage (omega); verl-agent's default step_advantage_w, not a config key.
STEP_ADVANTAGE_WEIGHT = 1.0


@register_advantage("gigpo")
@torch.no_grad()
def gigpo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GiGPO (arXiv:2505.10978): grpo's A plus omega times the step's discounted return, normalised as grpo
    within its step group (``step_groups.py``), on the step's tokens. Needs the step inputs."""
    return weighted_gigpo_advantages(inputs, STEP_ADVANTAGE_WEIGHT)


def weighted_gigpo_advantages(inputs: AdvantageInputs, step_weight: float) -> AdvantageOutputs:
    """gigpo with omega = ``step_weight`` (0: grpo exactly)."""
    if inputs.turn_index is None:
        raise ValueError("adv_estimator 'gigpo' needs per-step inputs (AdvantageInputs.turn_index, step_rewards, "
                         "step_anchors), which multi-turn runs with worker.rollout.environment make")
    episode = grpo_advantages(inputs).advantages  # (B, T)
    taken = steps_taken(inputs.turn_index, inputs.step_rewards.shape[1])  # (B, S)
    returns = step_returns(inputs.step_rewards.float(), inputs.gamma)
    step_ids = step_group_ids(inputs.group_ids, inputs.step_anchors, taken)
    step = torch.zeros_like(returns)
    step[taken] = group_normalised(returns[taken], step_ids, inputs.norm_by_std, inputs.eps)
    advantages = zero_masked(episode + step_weight * on_step_tokens(step, inputs.turn_index), inputs.response_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)
