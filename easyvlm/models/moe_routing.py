"""Routing of MoE decoders: record each token's experts and replay them later (Rollout Routing Replay, arXiv
2510.11370, verl's ``router_replay.mode``), load-balancing statistics. Replays: (N, layers, k), tokens row-major,
``FREE`` = route by logits. docs/models.md, "MoE: routing, the load-balancing loss, router replay"."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# transformers' top-k routers of the MoE families easyvlm trains (their forward is the same: softmax
# in float32, top-k, weights renormalised over the chosen experts)
ROUTER_CLASSES = frozenset({"Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter"})
FREE = -1
"""A replayed expert index meaning "route this token by its own logits"."""


class RoutingState:
    """What a model's routers do in the next forward, and what they chose in the last one."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.replay: Tensor | None = None  # (N, layers, k) long, FREE = route freely
        self.keep_logits = False
        self.chosen: list[Tensor | None] = [None] * num_layers  # per MoE layer: (N, k) of the last forward
        self.free: list[Tensor | None] = [None] * num_layers  # per MoE layer, with a replay: (N, k) its own top-k
        self.logits: list[Tensor | None] = [None] * num_layers  # per MoE layer: (N, E), with keep_logits
        self.batch_routing: Tensor | None = None  # the last forward's choices in its batch's layout (the workers')
        self.token_mask: Tensor | None = None  # (N,) the last forward's tokens that count in statistics
        self.batch_record: Tensor | None = None  # (N, layers, k) the batch's routed_experts there (the workers')

    @contextmanager
    def forward(self, replay: Tensor | None = None, keep_logits: bool = False) -> Iterator["RoutingState"]:
        """The routers of the forward run inside this context replay ``replay`` (or route freely)
        and keep their logits (with their graph: the load-balancing loss) if ``keep_logits``."""
        if replay is not None and (replay.dim() != 3 or replay.shape[1:] != (self.num_layers, self.top_k)):
            raise ValueError(f"a routing replay is (tokens, {self.num_layers} MoE layers, top-{self.top_k}); "
                             f"got {tuple(replay.shape)}")
        self.replay, self.keep_logits = replay, keep_logits
        self.chosen = [None] * self.num_layers
        self.free = [None] * self.num_layers
        self.logits = [None] * self.num_layers
        try:
            yield self
        finally:
            # the replay stays until the next forward: gradient checkpointing recomputes the
            # checkpointed layers in the backward pass, after this context, and their routers must
            # choose the experts this forward chose (else torch's CheckpointError, or other experts)
            self.keep_logits = False

    def recorded(self) -> Tensor:
        """(N, layers, k) int64: the experts every router chose in the last forward."""
        missing = [i for i, c in enumerate(self.chosen) if c is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} did not run in the last forward: nothing to record")
        return torch.stack([c for c in self.chosen if c is not None], dim=1)

    def free_choices(self) -> Tensor:
        """(N, layers, k) int64: the experts every router of the last forward would have chosen by its
        own logits (what it chose, where nothing was replayed)."""
        chosen = self.recorded()
        return torch.stack([f if f is not None else chosen[:, i] for i, f in enumerate(self.free)], dim=1)


class ReplayRouter(nn.Module):
    """A top-k router of ``state``'s model (MoE layer ``layer``): transformers' computation, or the
    replayed experts' current probabilities when ``state.replay`` is set."""

    def __init__(self, original: nn.Module, layer: int, state: RoutingState):
        super().__init__()
        self.weight = original.weight  # (E, H): the same parameter, the same name
        self.top_k, self.num_experts, self.hidden_dim = original.top_k, original.num_experts, original.hidden_dim
        self.layer = layer
        self.state = state

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)  # (N, E)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top_values, top_index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        replay = self.state.replay
        if replay is not None:
            if replay.shape[0] != hidden_states.shape[0]:
                raise ValueError(f"routing replay of {replay.shape[0]} tokens for a forward of {hidden_states.shape[0]}")
            chosen = replay[:, self.layer].to(device=top_index.device, dtype=top_index.dtype)
            free = (chosen == FREE).any(-1, keepdim=True)
            self.state.free[self.layer] = top_index.detach()  # what replay overrides (actor/moe/routing_mismatch)
            top_index = torch.where(free, top_index, chosen)
            top_values = probs.gather(-1, top_index)
        top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        self.state.chosen[self.layer] = top_index.detach()
        if self.state.keep_logits:
            self.state.logits[self.layer] = logits
        return logits, top_values.to(logits.dtype), top_index


def routing_state(model: nn.Module) -> RoutingState | None:
    """The shared state of ``model``'s replay routers (through PEFT and FSDP wrappers), or None without them."""
    for module in model.modules():
        if isinstance(module, ReplayRouter):
            return module.state
    return None


def install_replay_routers(model: nn.Module) -> RoutingState | None:
    """Replace every transformers top-k router of ``model`` (in layer order) by a
    :class:`ReplayRouter` sharing one :class:`RoutingState`; returns it, or None without routers."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__ in ROUTER_CLASSES]
    if not found:
        return None
    tops = {(child.top_k, child.num_experts) for _, _, child in found}
    if len(tops) != 1:
        raise ValueError(f"routers with different (top_k, num_experts): {sorted(tops)}")
    (top_k, num_experts), = tops
    state = RoutingState(len(found), top_k, num_experts)
    for layer, (parent, name, child) in enumerate(found):
        setattr(parent, name, ReplayRouter(child, layer, state))
    return state


def is_moe_config(hf_config: Any) -> bool:
    """Whether the (text) config has a sparse MoE decoder easyvlm can route (experts and top-k)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(text, "num_experts", 0) or 0) > 1 and int(getattr(text, "num_experts_per_tok", 0) or 0) > 0


def expert_load(chosen: Tensor, num_experts: int) -> Tensor:
    """(layers, E) share of routed token slots per expert, times E (1.0 everywhere is perfect
    balance). ``chosen``: (N, layers, k). E = 4, k = 2, tokens {0, 1} and {0, 2} -> [2, 1, 1, 0]."""
    tokens, layers, k = chosen.shape
    counts = F.one_hot(chosen.long(), num_experts).sum(dim=(0, 2)).float()  # (layers, E)
    return counts * num_experts / max(tokens * k, 1)


def load_balancing_loss(logits: list[Tensor], num_experts: int, top_k: int, token_mask: Tensor | None = None) -> Tensor:
    """transformers' auxiliary load-balancing loss (Switch Transformer's) over the routers' (N, E)
    logits of one forward, counting the tokens of ``token_mask`` (N,) only (default: all)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(logits), num_experts, top_k, token_mask)
