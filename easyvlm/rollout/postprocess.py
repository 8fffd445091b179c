"""Sampled token lists -> the rollout Batch, for every engine. B rows, P prompt tokens (left padded),
T = max_response_length (fixed, so several calls' batches concatenate)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from easyvlm.data.batch import PROMPT_TENSOR_KEYS, Batch
from easyvlm.models.position_ids import extend_position_ids

# The prompt keys that generate() replaces with prompt + response versions.


def pad_responses(responses: Sequence[Sequence[int]], response_length: int, pad_token_id: int) -> Tensor:
    """Lists of sampled ids -> (B, T) int64, right padded; raises ValueError for a row longer than T."""
    out = torch.full((len(responses), response_length), pad_token_id, dtype=torch.long)
    for i, ids in enumerate(responses):
        if len(ids) > response_length:
            raise ValueError(f"response {i} has {len(ids)} tokens, more than response_length={response_length}")
        out[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return out


def pad_logprobs(logprobs: Sequence[Sequence[float]], response_length: int) -> Tensor:
    """Per-token log-probs -> (B, T) float32, 0.0 after the end of each response."""
    out = torch.zeros(len(logprobs), response_length, dtype=torch.float32)
    for i, values in enumerate(logprobs):
        if len(values) > response_length:
            raise ValueError(f"logprobs {i} has {len(values)} values, more than response_length={response_length}")
        out[i, : len(values)] = torch.as_tensor(list(values), dtype=torch.float32)
    return out


def build_response_mask(responses: Tensor, response_lengths: Tensor, eos_token_ids: Sequence[int]) -> Tensor:
    """(B, T) bool: True up to and including the first EOS (EasyR1's rule, also under ``ignore_eos``).
    ``response_lengths`` (B,), not the pad id, ends a row: Qwen's pad id is also an EOS id."""
    positions = torch.arange(responses.shape[1], device=responses.device)
    sampled = positions.unsqueeze(0) < response_lengths.unsqueeze(1)  # (B, T)
    eos = torch.isin(responses, torch.as_tensor(list(eos_token_ids), device=responses.device)) & sampled
    eos_before = eos.long().cumsum(dim=1) - eos.long()  # EOS strictly before each position
    return sampled & (eos_before == 0)


def concat_prompt_response(
    prompts: Tensor,
    prompt_attention_mask: Tensor,
    prompt_position_ids: Tensor,
    responses: Tensor,
    response_mask: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt (B, P) + response (B, T) -> input_ids, attention_mask (response part: ``response_mask``)
    and position_ids over P+T."""
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_attention_mask.bool(), response_mask.bool()], dim=1)
    position_ids = extend_position_ids(prompt_position_ids, responses.shape[1])
    return input_ids, attention_mask, position_ids


def build_rollout_batch(
    prompts: Batch,
    responses: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    response_length: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
) -> Batch:
    """``RolloutEngine.generate``'s Batch from the repeated prompts and a response and log-prob list per row."""
    if len(responses) != len(prompts) or len(logprobs) != len(prompts):
        raise ValueError(f"{len(responses)} responses and {len(logprobs)} logprob rows for {len(prompts)} prompts")
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    if any(len(lp) != len(r) for lp, r in zip(logprobs, responses)):
        raise ValueError("every response needs exactly one log-prob per token")
    response_ids = pad_responses(responses, response_length, pad_token_id)  # (B, T)
    response_mask = build_response_mask(response_ids, lengths, eos_token_ids)  # (B, T)
    rest = prompts.copy()
    prompt_tensors = rest.pop(*PROMPT_TENSOR_KEYS)
    input_ids, attention_mask, position_ids = concat_prompt_response(
        prompt_tensors["input_ids"],
        prompt_tensors["attention_mask"],
        prompt_tensors["position_ids"],
        response_ids,
        response_mask,
    )
    new = Batch(
        {
            "prompts": prompt_tensors["input_ids"],
            "responses": response_ids,
            "response_mask": response_mask,
            "rollout_logprobs": pad_logprobs(logprobs, response_length) * response_mask,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
    )
    return rest.union(new)
