"""MoE routing in the workers' forward passes: which experts a pass replays, what it recorded, and the
router's load-balancing loss and load metrics (``worker.actor.router_replay``,
``worker.actor.router_aux_loss_coef``; the routers themselves: ``easyvlm.models.moe_routing``).

A Batch carries routing as ``routed_experts`` (B, L, layers, k) int16, aligned with ``input_ids``
(FREE where nothing was recorded: padding, the vision dummy's row). R2: the old-log-prob pass
records it and the update replays it; R3: the sampler recorded it, and the old, reference and
update passes replay it.
"""

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
    """Run one model forward over ``batch`` (packed: ``token_index``, ``padded_to_packed`` of
    ``pack_inputs``; padded: None) with the routing its ``setup`` (``forward.ForwardSetup``) asks
    for: replay ``routed_experts`` unless the setup's mode is disabled, keep the router logits in a
    training pass. Afterwards ``setup.routing.batch_routing`` holds the (B, L, layers, k) choices,
    ``token_mask`` the forward's sample tokens and ``batch_record`` the batch's ``routed_experts``
    over its tokens (replayed or not). Dense models: nothing."""
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
    """(N,) bool over a forward's tokens: True for the samples' attended tokens, False for padding and
    the vision dummy's row (a row without a response token), which the statistics leave out."""
    mask = batch["attention_mask"].bool()
    B, L = mask.shape
    T = batch["responses"].shape[1]
    has_response = (mask[:, L - T :] & mask[:, L - T - 1 : L - 1]).any(-1)  # (B,)
    tokens = (mask & has_response[:, None]).reshape(-1)
    return tokens if token_index is None else tokens[token_index.to(tokens.device)]


def routing_tokens(batch: Batch, token_index: Tensor | None, device: torch.device) -> Tensor | None:
    """``batch``'s recorded routing (``routed_experts``) over a forward's tokens in the model's order,
    (N, layers, k) int64, or None when it has none."""
    if ROUTED_EXPERTS_KEY not in batch:
        return None
    routed = batch[ROUTED_EXPERTS_KEY].to(device)  # (B, L, layers, k)
    flat = routed.reshape(-1, *routed.shape[2:]).long()
    return flat if token_index is None else flat[token_index]


def routing_mismatch(free: Tensor, record: Tensor, token_mask: Tensor) -> float | None:
    """The share of the sample tokens (``token_mask``) with a record whose own top-k experts
    (``free``, (N, layers, k)) differ from the recorded ones in at least one MoE layer, each compared
    as a set of k; None when no such token has a record. Under R3 it is how often the trainer would
    route a token otherwise than the sampler did, under R2 (the update) otherwise than the
    old-log-prob pass."""
    recorded = token_mask.to(record.device) & (record != FREE).all(-1).all(-1)
    count = int(recorded.sum())
    if count == 0:
        return None
    differs = (free.sort(-1).values != record.sort(-1).values).any(-1).any(-1)
    return float((differs & recorded).sum()) / count


def padded_routing(recorded: Tensor, attention_mask: Tensor, padded_to_packed: Tensor | None) -> Tensor:
    """(N, layers, k) choices of one forward -> (B, L, layers, k) int16 aligned with ``input_ids``
    ((B, L) ``attention_mask``): a packed row's tokens go back to their padded positions (a shared
    prompt's to every row that reused it); padding gets FREE."""
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
    """``routed`` (B, L, layers, k) for a batch grown by the vision dummy to (rows, columns): new rows
    and new left columns route freely (no sampler saw those tokens)."""
    B, L = routed.shape[:2]
    out = routed.new_full((rows, columns, *routed.shape[2:]), FREE)
    out[:B, columns - L :] = routed
    return out


def routing_metrics(state: RoutingState) -> dict[str, float]:
    """actor/moe/expert_load_{max,min} of the last forward's sample tokens: the busiest and idlest
    expert's share of the routed token slots times the expert count, over every MoE layer (1.0 =
    balanced); actor/moe/routing_mismatch where the batch carries routing (:func:`routing_mismatch`)."""
    load = expert_load(state.recorded()[state.token_mask.to(state.recorded().device)], state.num_experts)
    metrics = {"moe/expert_load_max": float(load.max()), "moe/expert_load_min": float(load.min())}
    if state.batch_record is not None:  # the batch carries routing (R2's update, R3)
        mismatch = routing_mismatch(state.free_choices(), state.batch_record, state.token_mask)
        if mismatch is not None:
            metrics["moe/routing_mismatch"] = mismatch
    return metrics


def aux_loss(state: RoutingState) -> Tensor:
    """The model's load-balancing loss over the last forward's router logits (kept: keep_logits) at
    the samples' tokens."""
    logits = [logits for logits in state.logits if logits is not None]
    return load_balancing_loss(logits, state.num_experts, state.top_k, state.token_mask)


def concat_routing(parts: list[Tensor], length: int) -> Tensor:
    """Micro-batches' (b, L_i, layers, k) routing, each cut to the batch's last ``length`` columns
    (the vision dummy may have added one on the left), concatenated over the batch."""
    return torch.cat([part[:, -length:] for part in parts])

