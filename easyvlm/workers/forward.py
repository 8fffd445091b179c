"""Forward passes shared by the actor, reference and critic: model inputs from a Batch (padded or
packed), outputs at the positions that predict response tokens, micro-batching.

Indexing. A row is ``prompt (P, left padded) + response (T, right padded)``, L = P + T. The output
at position P - 1 + t predicts response token t, so the log-prob of ``responses[:, t]`` (and the
critic's value of the state before it) is read at position P - 1 + t. Response positions whose
token or predecessor is not attended (padding) are "invalid" and get 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.padding_free import pack_inputs

MULTI_MODAL_KEY = "multi_modal_inputs"


def response_valid_mask(attention_mask: Tensor, response_length: int) -> Tensor:
    """(B, L) -> (B, T) bool: response token t and its predecessor are both attended."""
    L = attention_mask.shape[1]
    P = L - response_length
    mask = attention_mask.bool()
    return mask[:, P:] & mask[:, P - 1 : L - 1]


def response_outputs(
    model: nn.Module,
    batch: Batch,
    *,
    padding_free: bool,
    device: torch.device,
    lm_head: bool = True,
) -> tuple[Tensor, Tensor]:
    """Model outputs at the positions predicting the valid response tokens.

    batch: ``input_ids``, ``attention_mask`` (B, L), ``position_ids`` (B, L) or (B, R, L),
    ``responses`` (B, T), optionally object ``multi_modal_inputs``. Returns ``(outputs (K, C),
    valid (B, T))``: K = valid.sum(), rows in row-major order of ``valid``; C = V (logits) or 1 (values).
    ``lm_head``: the model takes ``logits_to_keep`` (causal LMs), so the head runs on K positions only.
    """
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device).bool()
    position_ids = batch["position_ids"].to(device)
    B, L = input_ids.shape
    T = batch["responses"].shape[1]
    P = L - T
    if P < 1:
        raise ValueError(f"batch has input_ids of length {L} and responses of length {T}: no prompt token")
    valid = response_valid_mask(attention_mask, T)  # (B, T)
    extra: dict[str, Any] = {
        k: v.to(device) for k, v in concat_multi_modal_inputs(batch.get(MULTI_MODAL_KEY) or []).items()
    }
    extra["use_cache"] = False

    if padding_free:
        packed = pack_inputs(input_ids, attention_mask, position_ids)
        index = packed.padded_to_packed[:, P - 1 : L - 1][valid]  # (K,) packed positions
        if lm_head:
            extra["logits_to_keep"] = index
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **extra).logits  # (1, K|N, C)
        return (out[0] if lm_head else out[0, index]), valid
    if lm_head:
        extra["logits_to_keep"] = T + 1  # positions P-1 .. L-1; the last one predicts nothing
    # transformers' mRoPE models take the rows first: (B, R, L) -> (R, B, L)
    model_position_ids = position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=model_position_ids, **extra).logits
    return out[:, -(T + 1) : -1][valid], valid  # (K, C)


def scatter_response(values: Tensor, valid: Tensor) -> Tensor:
    """(K,) values at the True positions of ``valid`` (B, T) -> (B, T), 0 elsewhere (keeps grad)."""
    out = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    out[valid] = values
    return out


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[label]. logits (K, V), labels (K,) -> (K,) float32."""
    logits = logits.float() / temperature
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_lengths(batch: Batch) -> list[int]:
    """Attended tokens per sample (what a padding-free micro-batch costs)."""
    return batch["attention_mask"].bool().sum(-1).tolist()


def split_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sample indices whose lengths sum to at most ``budget`` (a sample
    longer than the budget gets a group of its own). Order is kept: [3, 4, 2, 5], 7 -> [[0, 1], [2, 3]]."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def micro_batches(batch: Batch, micro_batch_size: int, token_budget: int | None = None) -> list[Batch]:
    """Fixed-size micro-batches, or (``token_budget`` given) consecutive ones of at most that many
    attended tokens. Sample order is kept either way."""
    if token_budget is None:
        return batch.split(micro_batch_size)
    return [batch.index(group) for group in split_by_token_budget(token_lengths(batch), token_budget)]
