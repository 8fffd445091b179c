"""Which tokens carry the policy gradient: TRL's two filters, as (B, T) bool gates.

The actor passes the gate to the policy loss (``PolicyLossInputs.token_gate``), which multiplies
the gated-off tokens' losses by 0; they still count in the normaliser (as in TRL and both papers),
so a filter removes gradient, it does not re-weight the rest.

- :func:`high_entropy_gate`: "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
  RL for LLM Reasoning", Wang et al., arXiv:2506.01939 (TRL's ``top_entropy_quantile``).
- :func:`off_policy_sequence_gate`: DeepSeek-V3.2, arXiv:2512.02556, eqn. 9, off-policy sequence
  masking (TRL's ``off_policy_mask_threshold``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask, masked_sum


@torch.no_grad()
def high_entropy_gate(entropies: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """(B, T) bool: valid tokens whose entropy is >= the (1 - top_quantile) quantile of the valid
    tokens' entropies (torch.quantile, linear interpolation, as TRL).

    entropies: (B, T) float. mask: (B, T) bool. top_quantile in [0, 1]: 1 keeps every valid token,
    0 only the highest-entropy one(s). The quantile is over the tokens given (the actor passes a
    micro-batch; TRL gathers one micro-step over its processes).
    """
    check_mask(mask, entropies)
    if not 0.0 <= top_quantile <= 1.0:
        raise ValueError(f"worker.actor.top_entropy_quantile must be in [0, 1], got {top_quantile}")
    valid = entropies[mask].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1.0 - top_quantile)
    return mask & (entropies.float() >= threshold)


@torch.no_grad()
def off_policy_sequence_gate(
    advantages: Tensor, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """(B, T) bool: False for every token of a sequence with a negative advantage whose mean
    log(pi_sampler / pi_theta) over its valid tokens exceeds ``threshold``; else the mask.

    DeepSeek-V3.2 eqn. 9: M_i = 0 if A_i < 0 and (1/|o_i|) sum_t log(pi_old(o_t) / pi_theta(o_t)) >
    delta, else 1, with pi_old the policy that sampled (pass the sampler's log-probs where they
    exist: they see both the updates since sampling and the engine's numerical mismatch).
    advantages, logprobs, sampler_logprobs: (B, T); the sequence's advantage is its mean over valid
    tokens (equal to A_i for the outcome estimators; TRL reads a (B, 1) advantage).
    """
    check_mask(mask, logprobs)
    lengths = mask.sum(dim=-1).clamp(min=1)
    mean_log_ratio = masked_sum(sampler_logprobs - logprobs.detach(), mask, dim=-1) / lengths  # (B,)
    seq_advantage = masked_sum(advantages, mask, dim=-1) / lengths
    drop = (seq_advantage < 0) & (mean_log_ratio > threshold)
    return mask & ~drop.unsqueeze(-1)
