"""Advantage estimators: ``AdvantageInputs -> AdvantageOutputs``, registered by name.

Every estimator takes the same typed input and returns advantages and returns of shape (B, T),
0 at masked positions. Get one with ``get_advantage(name_or_spec)``; ``advantage_names()`` lists
the built-in ones. A user estimator is a ``file.py:func`` with the same signature.

Conventions: ``token_rewards`` carry the sequence reward at the last valid token (plus per-token
KL penalties when KL goes into the reward); the sequence reward of an outcome estimator is
``sum_t token_rewards`` over valid tokens. Samples with the same ``group_ids`` value answer the
same prompt; groups may have any sizes and any order.

Departures from the papers:
- Group of one sample: grpo, rloo and grpo_passk give it advantage 0 (the sample is its own
  baseline: no signal); reinforce_plus_plus_baseline gives it a centred reward of 0 before the
  batch whitening. EasyR1 raises; verl uses the raw reward. The config validator rejects
  ``rollout.n < 2`` for these estimators.
- grpo / grpo_passk divide by (std + eps), std with Bessel's correction (torch.std), so a group of
  equal rewards gets 0, not NaN.
- gae / reinforce_plus_plus: masked positions are *skipped* by the backward recursion (the value
  and return carry over them, no discount step). For a right-padded mask this is the classic
  recursion with everything after EOS ignored ("reset at EOS"); for masks with holes (e.g. tool
  output in multi-turn) it bridges the hole instead of cutting the return.
- Whitening (gae, reinforce_plus_plus, reinforce_plus_plus_baseline) uses the population variance
  over all valid tokens of the batch, with eps=1e-8 inside the square root.
- remax: the advantage is sequence-level, sum_t r_t - b (the paper's REINFORCE form);
  ``returns`` are the undiscounted rewards-to-go.
- gigpo: a step group of one step gets step advantage 0 (verl-agent: its raw discounted return);
  one sample per trajectory (verl-agent: one row per step), see docs/algorithms.md.
"""

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
    """Everything an estimator may read. Hyperparameters an estimator does not use are ignored."""

    token_rewards: Tensor
    """(B, T) float: sequence reward at the last valid token, KL penalties per token if KL-in-reward."""
    response_mask: Tensor
    """(B, T) bool: True = a response token that counts."""
    group_ids: Tensor
    """(B,) int64: samples with the same id answer the same prompt."""
    values: Tensor | None = None
    """(B, T) float: critic values V(s_t) (gae only)."""
    baseline_rewards: Tensor | None = None
    """(B,) float: reward of the greedy response to the same prompt (remax only)."""
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    eps: float = 1e-6
    """Added to the group std before dividing (grpo, grpo_passk)."""
    norm_by_std: bool = True
    """grpo / grpo_passk / gigpo: divide by the group std; False = Dr. GRPO (arXiv:2503.20783)."""
    turn_index: Tensor | None = None
    """(B, T) int64: the step (model turn) of each response token, -1 elsewhere (gigpo only)."""
    step_rewards: Tensor | None = None
    """(B, S) float: each step's reward from the environment, 0 past a sample's steps (gigpo only)."""
    step_anchors: Tensor | None = None
    """(B, S) int64: the identity of the state each step started from (gigpo only)."""

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
    """(B, T) float, 0 at masked positions."""
    returns: Tensor
    """(B, T) float, 0 at masked positions: value targets for the critic (gae)."""


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.adv_estimator")
register_advantage = ADVANTAGES.register


def advantage_names() -> tuple[str, ...]:
    """Names of the built-in (and Python-registered) estimators."""
    return ADVANTAGES.names()


def get_advantage(name_or_spec: str) -> AdvantageFn:
    """The estimator for a registered name or a ``path/to/file.py:func`` plug-in.

    A plug-in is called with an :class:`AdvantageInputs` and must return an
    :class:`AdvantageOutputs` with (B, T) tensors; the returned function checks that and says
    which file broke it.
    """
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
    """Per-sample group mean, std (Bessel-corrected, 0 for a group of one) and group size.

    seq_values: (B,) float. group_ids: (B,) int. Returns three (B,) tensors, each sample getting
    the statistic of its own group.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) group index 0..n_groups-1
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = seq_values.new_zeros(n_groups)
    count = zeros.index_add(0, inverse, torch.ones_like(seq_values))
    mean = zeros.index_add(0, inverse, seq_values) / count
    # two passes (subtract the mean first) for accuracy
    sq_dev = zeros.index_add(0, inverse, (seq_values - mean[inverse]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def _broadcast(seq_advantages: Tensor, mask: Tensor) -> Tensor:
    """(B,) -> (B, T): the sequence value at every valid token, 0 elsewhere."""
    return zero_masked(seq_advantages.unsqueeze(-1).expand(mask.shape), mask)


def _outcome(seq_advantages: Tensor, mask: Tensor) -> AdvantageOutputs:
    advantages = _broadcast(seq_advantages, mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next valid position; masked positions skipped, 0.

    token_rewards: (B, T). response_mask: (B, T) bool. Returns (B, T).
    """
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
    """Generalised advantage estimation. Schulman et al., arXiv:1506.02438, eqn. 16.

    delta_t = r_t + gamma * V_{t+1} - V_t (V = 0 after the last valid token);
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V (unwhitened); advantages are then
    whitened over all valid tokens of the batch. Needs ``values`` (B, T).
    """
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
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps). DeepSeekMath, arXiv:2402.03300, sec. 4.1.2.

    With ``norm_by_std=False``: A_i = r_i - mean(r_group), Dr. GRPO, arXiv:2503.20783. The
    sequence advantage is put on every valid token. A group of one sample gets 0.
    """
    rewards = seq_rewards_of(inputs)  # (B,)
    mean, std, _ = group_stats(rewards, inputs.group_ids)
    seq_advantages = rewards - mean  # exactly 0 for a group of one (its mean is itself)
    if inputs.norm_by_std:
        seq_advantages = seq_advantages / (std + inputs.eps)
    return _outcome(seq_advantages, inputs.response_mask)


@register_advantage("rloo")
@torch.no_grad()
def rloo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r_group)).

    REINFORCE leave-one-out: Kool et al. 2019; Ahmadian et al., arXiv:2402.14740.
    A group of one sample (no other sample to compare with) gets 0.
    """
    rewards = seq_rewards_of(inputs)
    mean, _, count = group_stats(rewards, inputs.group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), 0.0)
    return _outcome(scale * (rewards - mean), inputs.response_mask)


@register_advantage("grpo_passk")
@torch.no_grad()
def grpo_passk_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Advantage for the best-of-G (pass@k with k = G) objective. Tang et al., arXiv:2503.19595.

    The objective is the group maximum max_j r_j; with a leave-one-out baseline each sample gets
    A_i = max_j r_j - max_{j != i} r_j: the single best sample gets r_max - r_second_max, every
    other sample (and every sample of a tie for the best) gets 0. Divided by (std(r_group) + eps)
    unless ``norm_by_std=False`` (verl's choice, which EasyR1 follows). A group of one gets 0.
    """
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
    """REINFORCE++: discounted return per token, whitened over the batch. Hu, arXiv:2501.03262.

    G_t = sum_{s >= t, valid} gamma^(s-t) r_s (the sequence ends at its last valid token);
    advantages = whiten(G) over all valid tokens of the batch; returns = G.
    """
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, inputs.gamma)
    return AdvantageOutputs(advantages=masked_whiten(returns, inputs.response_mask), returns=returns)


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline: r_i - mean(r_group) on every token, then whitened over the batch.

    Hu, arXiv:2501.03262 (the group-baseline variant of later versions). returns = advantages.
    """
    rewards = seq_rewards_of(inputs)
    mean, _, _ = group_stats(rewards, inputs.group_ids)
    centred = _broadcast(rewards - mean, inputs.response_mask)
    advantages = masked_whiten(centred, inputs.response_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


@register_advantage("remax")
@torch.no_grad()
def remax_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """A_i = r_i - b_i with b_i the reward of the greedy response. ReMax, arXiv:2310.10505.

    Needs ``baseline_rewards`` (B,). returns = undiscounted rewards-to-go (B, T).
    """
    if inputs.baseline_rewards is None:
        raise ValueError("adv_estimator 'remax' needs baseline_rewards (B,): the rewards of greedy responses")
    seq_advantages = seq_rewards_of(inputs) - inputs.baseline_rewards
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, gamma=1.0)
    return AdvantageOutputs(advantages=_broadcast(seq_advantages, inputs.response_mask), returns=returns)


@register_advantage("gpg")
@torch.no_grad()
def gpg_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GPG: A_i = alpha * (r_i - mean(r_group)) / F_norm with F_norm = 1 and alpha = B / (B - M).
    Chu et al., arXiv:2504.02546, the corrected advantage of its accurate gradient estimation
    (verl's ``gpg`` estimator).

    B: the samples of the step's batch; M: the "invalid" ones, those whose group has one reward
    for every sample (their advantage is 0, so without alpha they dilute the gradient). alpha
    scales the rest back up as if the batch had only valid samples; with every sample invalid all
    advantages are 0. verl counts differently: alpha = B / (samples whose reward is non-zero); for
    0/1 rewards the two agree exactly when the correct samples are as many as the samples in mixed
    groups (groups (1,0,0,0) + (0,0,0): the paper's 1.75, verl's 7; (1,0,0,0) + (1,1,1): both 1.75).
    A group of one sample gets 0 and counts as invalid. Use with ``worker.actor.loss_type=gpg``.
    """
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
    """GiGPO (Feng et al. 2025, arXiv:2505.10978): episode and step advantages on each step's tokens.

    A = A_E + omega * A_S(k) on the tokens of step k (omega = STEP_ADVANTAGE_WEIGHT = 1). A_E: grpo
    over the group's sequence rewards. A_S(k): the step's discounted return G_k = r_k + gamma G_{k+1}
    (``step_rewards``, ``gamma``) normalised as grpo within its step group: the steps of the same
    prompt group that start from the same anchor state (``step_anchors``). Needs ``turn_index``,
    ``step_rewards`` and ``step_anchors`` (a run with worker.rollout.environment).
    """
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
