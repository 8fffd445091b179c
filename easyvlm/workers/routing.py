"""MoE routing in the workers' forward passes: replay and record, load-balancing loss and load
metrics (docs/models.md, "MoE")."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

from easyvlm.data.batch import ROUTED_EXPERTS_KEY, Batch
from easyvlm.models.moe_routing import FREE, RoutingState, expert_load, load_balancing_loss

@contextmanager
def routed_forward(setup: Any, batch: Batch, token_index: Tensor | None,
                   padded_to_packed: Tensor | None) -> Iterator[None]:
    """Run one model forward over ``batch`` (``token_index`` None: padded) with the routing ``setup``
    asks for; afterwards ``setup.routing`` holds ``batch_routing`` (B, L, layers, k), ``token_mask``
    and ``batch_record``. Dense models: nothing."""
    state = setup.routing
    if state is None:
        yield
        return
    record = routing_tokens(batch, token_index, setup.device)
    replay = None if setup.router_replay == "disabled" else record
    with state.forward(replay=replay, keep_logits=setup.keep_router_logits and torch.is_grad_enabled()):
        yield
    state.batch_routing = padded_routing(state.recorded(), batch["attention_mask"], padded_to_packed)
    state.token_mask = sample_tokens(batch, token_index).to(setup.device)
    state.batch_record = record  # for routing_metrics: computed only where logged (no device sync per pass)


def sample_tokens(batch: Batch, token_index: Tensor | None) -> Tensor:
    """(N,) bool over a forward's tokens: the samples' attended tokens (not padding, not the vision dummy)."""
    mask = batch["attention_mask"].bool()
    B, L = mask.shape
    T = batch["responses"].shape[1]
    has_response = (mask[:, L - T :] & mask[:, L - T - 1 : L - 1]).any(-1)  # (B,)
    tokens = (mask & has_response[:, None]).reshape(-1)
    return tokens if token_index is None else tokens[token_index.to(tokens.device)]


def routing_tokens(batch: Batch, token_index: Tensor | None, device: torch.device) -> Tensor | None:
    """``batch``'s ``routed_experts`` over a forward's tokens in the model's order, (N, layers, k) int64; None without."""
    if ROUTED_EXPERTS_KEY not in batch:
        return None
    routed = batch[ROUTED_EXPERTS_KEY].to(device)  # (B, L, layers, k)
    flat = routed.reshape(-1, *routed.shape[2:]).long()
    return flat if token_index is None else flat[token_index]


def routing_mismatch(free: Tensor, record: Tensor, token_mask: Tensor) -> float | None:
    """The share of the recorded sample tokens whose own top-k set (``free``, (N, layers, k)) differs
    from the recorded one in some MoE layer; None when no token has a record."""
    recorded = token_mask.to(record.device) & (record != FREE).all(-1).all(-1)
    count = int(recorded.sum())
    if count == 0:
        return None
    differs = (free.sort(-1).values != record.sort(-1).values).any(-1).any(-1)
    return float((differs & recorded).sum()) / count


def padded_routing(recorded: Tensor, attention_mask: Tensor, padded_to_packed: Tensor | None) -> Tensor:
    """(N, layers, k) choices of one forward -> (B, L, layers, k) int16 aligned with ``input_ids``, FREE
    at padding."""
    B, L = attention_mask.shape
    recorded = recorded.to(torch.int16)
    if padded_to_packed is None:
        out = recorded.reshape(B * L, *recorded.shape[1:]).clone()
        keep = attention_mask.reshape(-1).bool().to(out.device)
    else:
        index = padded_to_packed.reshape(-1)
        out, keep = recorded[index.clamp(min=0)], index >= 0
    out[~keep] = FREE
    return out.reshape(B, L, *recorded.shape[1:])


def with_routing_rows(routed: Tensor, rows: int, columns: int) -> Tensor:
    """``routed`` (B, L, layers, k) grown to (rows, columns) for the vision dummy, FREE-padded."""
    B, L = routed.shape[:2]
    out = routed.new_full((rows, columns, *routed.shape[2:]), FREE)
    out[:B, columns - L :] = routed
    return out


def routing_metrics(state: RoutingState) -> dict[str, float]:
    """moe/expert_load_{max,min} of the last forward (share of slots x expert count; 1.0 = balanced)
    and moe/routing_mismatch where the batch carries routing."""
    load = expert_load(state.recorded()[state.token_mask.to(state.recorded().device)], state.num_experts)
    metrics = {"moe/expert_load_max": float(load.max()), "moe/expert_load_min": float(load.min())}
    if state.batch_record is not None:  # the batch carries routing (R2's update, R3)
        mismatch = routing_mismatch(state.free_choices(), state.batch_record, state.token_mask)
        if mismatch is not None:
            metrics["moe/routing_mismatch"] = mismatch
    return metrics


def aux_loss(state: RoutingState) -> Tensor:
    """The model's load-balancing loss over the last forward's kept router logits, at the samples' tokens."""
    logits = [logits for logits in state.logits if logits is not None]
    return load_balancing_loss(logits, state.num_experts, state.top_k, state.token_mask)


def concat_routing(parts: list[Tensor], length: int) -> Tensor:
    """Micro-batches' (b, L_i, layers, k) routing, each cut to the last ``length`` columns, concatenated."""
    return torch.cat([part[:, -length:] for part in parts])

