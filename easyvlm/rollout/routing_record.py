"""Router replay R3 for transformers' ``generate``: a forward hook records the experts each token was
routed to; a row's unrouted last token and all padding hold FREE."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from easyvlm.models.moe_routing import FREE, install_replay_routers, routing_state


class RoutingRecorder:
    """Records ``model``'s routing inside :meth:`generate_call`; keeps a (P + T, layers, k) int16
    tensor per sampled row until :meth:`take`."""

    def __init__(self, model: nn.Module):
        state = routing_state(model) or install_replay_routers(model)
        if state is None:
            raise ValueError(f"{type(model).__name__} has no MoE router to record")
        self.state = state
        self._calls: list[Tensor] | None = None  # inside generate_call: one (B, l, layers, k) per forward
        self._rows: list[Tensor] = []
        model.register_forward_hook(self._after_forward, with_kwargs=True)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._calls is None:
            return
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs["inputs_embeds"][..., 0]
        rows, length = tokens.shape[:2]
        chosen = self.state.recorded()  # (rows * length, layers, k), the forward's tokens in order
        self._calls.append(chosen.reshape(rows, length, *chosen.shape[1:]).to(torch.int16).cpu())

    @contextmanager
    def generate_call(self, attention_mask: Tensor) -> Iterator[list[int]]:
        """Record one ``generate`` over prompts with ``attention_mask`` (B, P); the caller appends the
        rows' response lengths (tokens kept, EOS included) to the yielded list before the block ends."""
        self._calls = []
        lengths: list[int] = []
        try:
            yield lengths
            self._rows += self._rows_of(attention_mask.cpu().bool(), lengths)
        finally:
            self._calls = None

    def _rows_of(self, attention_mask: Tensor, lengths: list[int]) -> list[Tensor]:
        calls = self._calls or []
        if not calls or calls[0].shape[1] != attention_mask.shape[1] or len(lengths) != attention_mask.shape[0]:
            raise RuntimeError("routing record: generate() did not start with one forward over the whole prompt")
        routed = torch.cat(calls, dim=1)  # (B, P + steps, layers, k)
        routed[:, : attention_mask.shape[1]][~attention_mask] = FREE
        prompt = attention_mask.shape[1]
        return [routed[b, : prompt + n] for b, n in enumerate(lengths)]

    def take(self, width: int) -> Tensor:
        """(rows, width = P + T, layers, k) of the rows recorded since the last take, FREE-padded."""
        rows, self._rows = self._rows, []
        out = torch.full((len(rows), width, self.state.num_layers, self.state.top_k), FREE, dtype=torch.int16)
        for b, row in enumerate(rows):
            out[b, : row.shape[0]] = row[:width]
        return out
