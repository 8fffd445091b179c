"""Pure functions the driver loop uses between worker calls."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor



def group_ids_from_uids(uids: Sequence[Hashable]) -> Tensor:
    """(B,) int64: equal uids (samples of one prompt) get equal ids, numbered by first appearance."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(uid, len(index)) for uid in uids], dtype=torch.long)


def place_seq_rewards(seq_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """token_rewards (B, T): each of seq_rewards (B,) at its last valid response token of
    response_mask (B, T) bool, 0 elsewhere; an empty response gets none (it has no loss token)."""
    B, T = response_mask.shape
    token_rewards = torch.zeros(B, T, dtype=torch.float32)
    # the last True position (multi-turn masks have gaps where tools answered), -1 if none
    last = torch.where(response_mask, torch.arange(T), -1).max(dim=-1).values  # (B,)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = seq_rewards[rows].float()
    return token_rewards


def count_tokens(attention_mask: Tensor) -> int:
    """Unpadded tokens (prompt + response) in a batch: the throughput numerator."""
    return int(attention_mask.bool().sum())
