"""How far the sampler's probabilities are from the trainer's: rollout-training mismatch metrics.

The rollout engine (vLLM: other kernels, other numerics; bf16 on GPUs) reports the log-prob of each
token it sampled; the actor computes the same token's log-prob under the same weights. They should
agree; the gap is what importance-sampling corrections (issue 18) correct. Per valid token, with
log r = log pi_train - log pi_rollout (samples drawn from pi_rollout):

- ``k1`` = mean(-log r): the plain estimator of KL(pi_rollout || pi_train);
- ``k3`` = mean(r - 1 - log r): Schulman's low-variance, always non-negative estimator of the same KL;
- ``ratio_mean`` = mean(r);
- ``ratio_outside`` = the share of tokens with r outside [1 / RATIO_BAND, RATIO_BAND].

All are token means, so the update averages them over micro-batches weighted by their tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask, masked_mean

RATIO_BAND = 2.0


def rollout_mismatch(train_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Mismatch metrics over the valid tokens of (B, T) log-probs (no grad needed; none kept)."""
    check_mask(response_mask, train_logprobs)
    with torch.no_grad():
        log_ratio = (train_logprobs.float() - rollout_logprobs.float()).masked_fill(~response_mask, 0.0)
        ratio = torch.exp(log_ratio)
        outside = (ratio > RATIO_BAND) | (ratio < 1.0 / RATIO_BAND)
        return {
            "k1": float(masked_mean(-log_ratio, response_mask)),
            "k3": float(masked_mean(ratio - 1.0 - log_ratio, response_mask)),
            "ratio_mean": float(masked_mean(ratio, response_mask)),
            "ratio_outside": float(masked_mean(outside.float(), response_mask)),
        }
