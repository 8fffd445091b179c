"""Loss aggregation: (B, T) per-token losses -> one scalar, split-invariant across micro-batches.

Modes (``worker.actor.loss_avg_mode``), with L_i the valid tokens of sequence i, S the number of
sequences with at least one valid token and l_it the token losses:

    "token"  (alias "token-mean")          sum_i sum_t l_it / sum_i L_i        DAPO, arXiv:2503.14476
    "seq"    (alias "seq-mean-token-mean") sum_i (sum_t l_it / L_i) / S        GRPO, arXiv:2402.03300
    "seq-mean-token-sum"                   sum_i sum_t l_it / S
    "seq-mean-token-sum-norm"              sum_i sum_t l_it / (S * norm_length) Dr. GRPO, arXiv:2503.20783
    "token-sum"                            sum_i sum_t l_it                     verl's token-sum

Global normalisation (how the actor must use this module)
---------------------------------------------------------
Every mode is ``numerator / N`` where the numerator is a sum over sequences and N, the
*normaliser*, depends only on the response masks. So the loss of a mini-batch is the sum of the
losses of its pieces, provided every piece divides by the N of the whole mini-batch:

1. Once per mini-batch, on each data-parallel rank: ``n = loss_normalizer(local_mask, mode,
   norm_length)`` over the rank's share of the mini-batch (all its micro-batches), then all-reduce
   it with SUM over the data-parallel group (N is additive over samples).
2. For each micro-batch: ``loss = policy_loss(..., normalizer=N) [+ kl / entropy terms with the
   same N]``, then ``(loss * dp_world_size).backward()``: gradients accumulate (sum) over
   micro-batches. Do NOT divide by the number of micro-batches (gradient accumulation steps).
   The ``* dp_world_size`` undoes FSDP's gradient *average* over ranks, so that the result is the
   *sum* over ranks (alternatively, set FSDP's gradient divide factor to 1 and skip it).
3. ``optimizer.step()`` once per mini-batch.

Then the gradient does not depend on how the mini-batch is cut into micro-batches and ranks
(dynamic batching included); ``tests/algorithms/test_aggregation.py`` checks exactly this.

Departures from the references:
- Sequences with no valid token count neither in L nor in S (a fully masked row is as if absent).
- "seq-mean-token-sum-norm" divides by a constant ``norm_length`` (pass
  ``data.max_response_length``), not the padded width of the tensor, which varies between
  micro-batches under dynamic batching; Dr. GRPO's code uses the generation budget too.
- A normaliser of 0 (no valid token anywhere) is replaced by 1, so the loss is 0, not NaN.
- "token-sum" has no normaliser: :func:`loss_normalizer` returns the token count (for the record)
  and :func:`aggregate_loss` ignores it, so the summed loss's gradient is the sum over every token
  of every micro-batch and rank (the actor's ``* dp_world_size`` undoes FSDP's average, as verl's
  ``* dp_size``). Its scale grows with the batch: lower the learning rate to match.
"""

from __future__ import annotations

import torch
from torch import Tensor

from easyvlm.algorithms.masked import check_mask, masked_sum
# the mode names are settings (torch-free, for the config check); the losses import them from here too
from easyvlm.algorithms.settings import LOSS_AVG_MODE_ALIASES, LOSS_AVG_MODES, canonical_loss_avg_mode  # noqa: F401


def loss_normalizer(response_mask: Tensor, loss_avg_mode: str, norm_length: int | None = None) -> float:
    """The denominator N of the mini-batch loss, computed from the mini-batch's masks.

    response_mask: (B, T) bool. norm_length: the constant length of "seq-mean-token-sum-norm"
    (default: T, the padded width of ``response_mask``; pass ``data.max_response_length``).
    Returns a float that is additive over samples: on several ranks, sum (all-reduce) the values
    computed on each rank's share of the mini-batch.
    """
    mode = canonical_loss_avg_mode(loss_avg_mode)
    if response_mask.dtype != torch.bool or response_mask.dim() != 2:
        shape = tuple(response_mask.shape)
        raise TypeError(f"response_mask must be a (B, T) bool tensor, got {response_mask.dtype} {shape}")
    if mode in ("token", "token-sum"):
        return float(response_mask.sum().item())
    num_seqs = float(response_mask.any(dim=-1).sum().item())
    if mode == "seq-mean-token-sum-norm":
        length = response_mask.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive for seq-mean-token-sum-norm, got {length}")
        return num_seqs * float(length)
    return num_seqs


def aggregate_loss(
    token_losses: Tensor, response_mask: Tensor, loss_avg_mode: str, normalizer: float | None = None
) -> Tensor:
    """Aggregate per-token losses into a scalar with the given mode (formulas in the module doc).

    token_losses: (B, T) float. response_mask: (B, T) bool. normalizer: N of the whole mini-batch
    from :func:`loss_normalizer`; None = compute it from ``response_mask`` (correct only when this
    is the whole mini-batch). Returns a 0-d tensor; masked positions never affect it.
    """
    mode = canonical_loss_avg_mode(loss_avg_mode)
    check_mask(response_mask, token_losses)
    if mode == "token-sum":
        return masked_sum(token_losses, response_mask)
    if normalizer is None:
        normalizer = loss_normalizer(response_mask, mode)
    if mode == "seq":
        seq_lengths = response_mask.sum(dim=-1).clamp(min=1)  # (B,); a sequence is never split
        numerator = (masked_sum(token_losses, response_mask, dim=-1) / seq_lengths).sum()
    else:
        numerator = masked_sum(token_losses, response_mask)
    return numerator / (normalizer if normalizer > 0 else 1.0)
