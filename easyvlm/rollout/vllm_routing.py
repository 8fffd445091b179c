"""Router replay R3 with the vLLM engine: the experts vLLM routed each token to, laid out as the
rollout batch's ``routed_experts`` (docs/rollout.md, "Router replay R3")."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from easyvlm.models.moe_routing import FREE


def moe_layer_ids(hf_config: Any) -> list[int]:
    """The decoder layers with a sparse MoE block, in order, by transformers' rule."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    return [i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def vllm_routed_experts(routed: np.ndarray | None, layer_ids: Sequence[int]) -> Tensor:
    """A request's ``routed_experts`` (tokens, decoder layers, k) -> (tokens, MoE layers, k) int16."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed_experts for a finished request (enable_return_routed_experts "
                           "is set when EngineSpec.record_routing is)")
    return torch.from_numpy(np.asarray(routed)[:, list(layer_ids)].astype(np.int16))


def lay_out_routing(sequences: Sequence[Tensor], prompt_mask: Tensor, response_lengths: Sequence[int],
                    width: int) -> Tensor:
    """(rows, width, layers, k) int16 aligned with the rollout batch's ``input_ids``: each row's routed
    sequence (prompt then response) starts at its prompt's first column of the left-padded
    ``prompt_mask`` (rows, P); FREE everywhere else. Raises on a prompt not left padded."""
    rows, P = prompt_mask.shape
    layers, k = next((s.shape[1:] for s in sequences), (0, 0))
    out = torch.full((rows, width, layers, k), FREE, dtype=torch.int16)
    for b, (seq, n) in enumerate(zip(sequences, response_lengths, strict=True)):
        p = int(prompt_mask[b].sum())
        if not bool(prompt_mask[b, P - p :].all()):
            raise ValueError(f"row {b}: the prompt is not left padded")
        if len(seq) > p + n:
            raise RuntimeError(f"row {b}: routing for {len(seq)} tokens, but the row has {p} prompt and {n} response tokens")
        out[b, P - p : P - p + len(seq)] = seq.to(torch.int16)
    return out


class StepCapture:
    """Bound to every MoE router of vLLM's model (CPU): files each forward's top-k ids per layer under
    the requests its rows belong to, read from the runner's batch as vLLM's own capture does."""

    def __init__(self, runner: Any, layer_ids: Sequence[int], top_k: int):
        self.runner = runner
        self.top_k = top_k
        self.column = {layer: i for i, layer in enumerate(sorted(layer_ids))}
        self.first = min(self.column)
        self._step: tuple[list[str], np.ndarray, np.ndarray] | None = None  # the forward in progress
        self._layers: list[Tensor | None] = []
        self._chunks: dict[str, list[tuple[int, Tensor]]] = {}  # request -> (first position, (n, layers, k))

    def capture(self, layer_id: int, topk_ids: Tensor) -> None:
        if layer_id == self.first:
            self._file()
            batch = self.runner.input_batch
            n = batch.num_reqs
            if n == 0:  # a forward without requests (vLLM's dummy runs): nothing to file
                return
            self._step = (list(batch.req_ids[:n]), batch.num_computed_tokens_cpu[:n].copy(),
                          self.runner.query_start_loc.np[: n + 1].copy())
            self._layers = [None] * len(self.column)
        if self._step is not None:
            self._layers[self.column[layer_id]] = topk_ids.to(device="cpu", dtype=torch.int16, copy=True)

    def _file(self) -> None:
        if self._step is None:
            return
        ids, starts, bounds = self._step
        self._step = None
        missing = [layer for layer, i in self.column.items() if self._layers[i] is None]
        if missing:
            raise RuntimeError(f"routing capture: MoE layers {missing} did not route the step's tokens")
        routed = torch.stack(self._layers, dim=1)  # (tokens, layers, k)
        if routed.shape[0] < bounds[-1]:
            raise RuntimeError(f"routing capture: {routed.shape[0]} routed rows for a step of {bounds[-1]} tokens")
        for request_id, start, lo, hi in zip(ids, starts.tolist(), bounds[:-1].tolist(), bounds[1:].tolist()):
            if hi > lo:
                self._chunks.setdefault(request_id, []).append((start, routed[lo:hi]))

    def take(self, request_ids: Sequence[str]) -> list[Tensor]:
        """(tokens, layers, k) int16 per request from position 0, FREE where never computed; forgets every
        request (call once per generation, after all its requests finished)."""
        self._file()
        chunks, self._chunks = self._chunks, {}
        out = []
        for request_id in request_ids:
            parts = chunks.get(request_id, [])
            length = max((start + len(rows) for start, rows in parts), default=0)
            seq = torch.full((length, len(self.column), self.top_k), FREE, dtype=torch.int16)
            for start, rows in parts:  # in step order: a recomputation (after a preemption) overwrites
                seq[start : start + len(rows)] = rows
            out.append(seq)
        return out


def install_step_capture(worker: Any) -> list[int]:
    """Run in vLLM's worker: bind a :class:`StepCapture` to the MoE routers; returns the layers bound."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    runner = worker.model_runner
    model = runner.get_model()
    layer_ids = sorted({module.layer_id for module in model.modules() if isinstance(module, MoERunner)})
    if not layer_ids:
        raise ValueError("router replay R3: vLLM's model has no MoE layer to capture")
    capture = StepCapture(runner, layer_ids, worker.vllm_config.model_config.get_num_experts_per_tok())
    bind_routed_experts_capturer(model, capture)
    worker.easyvlm_step_capture = capture
    return layer_ids


def take_step_capture(worker: Any, request_ids: Sequence[str]) -> list[Tensor]:
    """Run in vLLM's worker (``collective_rpc``): :meth:`StepCapture.take` of the worker's capture."""
    return worker.easyvlm_step_capture.take(request_ids)
