"""Pure functions the driver loop uses between worker calls (no Ray, no models, no config objects).

- group ids from prompt uids, sequence rewards placed on the last response token;
- DAPO's online filtering (dynamic sampling): which prompt groups carry a learning signal, and
  the concatenation of the kept samples of several generation rounds;
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor

from easyvlm.data.batch import ROUTED_EXPERTS_KEY, Batch
from easyvlm.models.moe_routing import FREE


def group_ids_from_uids(uids: Sequence[Hashable]) -> Tensor:
    """(B,) int64: equal uids (samples of one prompt) get equal ids, numbered by first appearance."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(uid, len(index)) for uid in uids], dtype=torch.long)


def place_seq_rewards(seq_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """token_rewards (B, T): each sequence reward at its last valid response token, 0 elsewhere.

    seq_rewards: (B,) float. response_mask: (B, T) bool. An empty response (no valid token) has
    nowhere to put its reward; it gets none (such rows have no token in the loss anyway).
    """
    B, T = response_mask.shape
    token_rewards = torch.zeros(B, T, dtype=torch.float32)
    # the last True position (multi-turn masks have gaps where tools answered), -1 if none
    last = torch.where(response_mask, torch.arange(T), -1).max(dim=-1).values  # (B,)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = seq_rewards[rows].float()
    return token_rewards


def groups_in_range(uids: Sequence[Hashable], values: Sequence[float], low: float, high: float) -> list[Hashable]:
    """Prompt uids whose group mean of ``values`` lies strictly inside (low, high), in order.

    DAPO (arXiv:2503.14476, sec. 3.2, dynamic sampling): a group whose samples all score the same
    (all right or all wrong) has zero advantage under group normalisation and teaches nothing.
    """
    sums: dict[Hashable, float] = {}
    counts: dict[Hashable, int] = {}
    for uid, value in zip(uids, values):
        sums[uid] = sums.get(uid, 0.0) + float(value)
        counts[uid] = counts.get(uid, 0) + 1
    return [uid for uid in sums if low < sums[uid] / counts[uid] < high]


def rows_of_groups(uids: Sequence[Hashable], keep: Sequence[Hashable]) -> list[int]:
    """Row indices of the samples whose uid is in ``keep``, in row order."""
    wanted = set(keep)
    return [i for i, uid in enumerate(uids) if uid in wanted]


def count_tokens(attention_mask: Tensor) -> int:
    """Unpadded tokens (prompt + response) in a batch: the throughput numerator."""
    return int(attention_mask.bool().sum())


def concat_rollouts(batches: Sequence[Batch], pad_token_id: int) -> Batch:
    """Batch.concat of rollout batches of different generation rounds.

    Each round's prompts are left padded to that round's longest prompt (P_i), so the prompt side
    of ``prompts`` (B, P_i), ``input_ids`` / ``attention_mask`` (B, P_i+T), ``position_ids``
    (B, P_i+T) or (B, R, P_i+T) and an MoE policy's ``routed_experts`` (B, P_i+T, layers, k) is first
    left padded to max P_i, with the data collator's values (``pad_token_id``, False, 0) and, for the
    routing, FREE (a padding column routes freely, as every padding position of one round does).
    The response side (T = max_response_length) already agrees.
    """
    width = max(b["prompts"].shape[1] for b in batches)
    padded = []
    for batch in batches:
        extra = width - batch["prompts"].shape[1]
        if extra:
            batch = batch.copy()
            for key, (value, dim) in _prompt_side_fill(pad_token_id).items():
                if key in batch:
                    t = batch[key]
                    shape = list(t.shape)
                    shape[dim] = extra
                    batch[key] = torch.cat([t.new_full(shape, value), t], dim=dim)
        padded.append(batch)
    return Batch.concat(padded)


def _prompt_side_fill(pad_token_id: int) -> dict[str, tuple[int | bool, int]]:
    """The rollout tensors whose columns include the prompt: key -> (fill value, the columns' dimension)."""
    return {"prompts": (pad_token_id, -1), "input_ids": (pad_token_id, -1), "attention_mask": (False, -1),
            "position_ids": (0, -1), ROUTED_EXPERTS_KEY: (FREE, 1)}
