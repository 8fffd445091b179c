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
    training pass. Afterwards ``setup.routing.batch_routing`` holds the (B, L, layers, k) choices
    and ``token_mask`` the forward's sample tokens. Dense models: nothing."""
    state = setup.routing
    if state is None:
        yield
        return
    replay = replay_tokens(batch, setup.router_replay, token_index, setup.device)
    with state.forward(replay=replay, keep_logits=setup.keep_router_logits and torch.is_grad_enabled()):
        yield
    state.batch_routing = padded_routing(state.recorded(), batch["attention_mask"], padded_to_packed)
    state.token_mask = sample_tokens(batch, token_index).to(setup.device)


def sample_tokens(batch: Batch, token_index: Tensor | None) -> Tensor:
    """(N,) bool over a forward's tokens: True for the samples' attended tokens, False for padding and
    the vision dummy's row (a row without a response token), which the statistics leave out."""
    mask = batch["attention_mask"].bool()
    B, L = mask.shape
    T = batch["responses"].shape[1]
    has_response = (mask[:, L - T :] & mask[:, L - T - 1 : L - 1]).any(-1)  # (B,)
    tokens = (mask & has_response[:, None]).reshape(-1)
    return tokens if token_index is None else tokens[token_index.to(tokens.device)]


def replay_tokens(batch: Batch, mode: str, token_index: Tensor | None, device: torch.device) -> Tensor | None:
    """The (N, layers, k) replay of a forward over ``batch``'s tokens in the model's order (the packed
    row's ``token_index`` into the flattened (B, L), or every position of the padded batch), or None
    when the pass routes freely (``mode`` disabled, or nothing recorded in the batch)."""
    if mode == "disabled" or ROUTED_EXPERTS_KEY not in batch:
        return None
    routed = batch[ROUTED_EXPERTS_KEY].to(device)  # (B, L, layers, k)
    flat = routed.reshape(-1, *routed.shape[2:]).long()
    return flat if token_index is None else flat[token_index]


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
    balanced)."""
    load = expert_load(state.recorded()[state.token_mask.to(state.recorded().device)], state.num_experts)
    return {"moe/expert_load_max": float(load.max()), "moe/expert_load_min": float(load.min())}


def aux_loss(state: RoutingState) -> Tensor:
    """The model's load-balancing loss over the last forward's router logits (kept: keep_logits) at
    the samples' tokens."""
    logits = [logits for logits in state.logits if logits is not None]
    return load_balancing_loss(logits, state.num_experts, state.top_k, state.token_mask)


def concat_routing(parts: list[Tensor], length: int) -> Tensor:
    """Micro-batches' (b, L_i, layers, k) routing, each cut to the batch's last ``length`` columns
    (the vision dummy may have added one on the left), concatenated over the batch."""
    return torch.cat([part[:, -length:] for part in parts])

