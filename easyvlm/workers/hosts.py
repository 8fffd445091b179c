"""The Ray actors of the worker groups other than the hybrid one, one per rank."""

from __future__ import annotations

import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import adapter_engine, streaming
from easyvlm.rollout.factory import build_rollout
from easyvlm.rollout.specs import RolloutSpec, Sampling
from easyvlm.workers.dist import init_distributed
from easyvlm.workers.specs import CriticSpec, RewardModelSpec
from easyvlm.workers.weight_transfer import Rendezvous, drain, nbytes, open_group, receive, transfer_device


class RolloutHost:
    """A rollout engine on its own device (``placement=separate``), no default process group. It samples
    with the last weights sent through the weight-transfer group (``receive_weights``) or as a Ray
    object (``load_weights``); ``stream_*`` forward the engine's `StreamingEngine` calls."""

    def __init__(self, spec: RolloutSpec):
        self.rollout = build_rollout(spec)
        self._transfer = None
        self._transfer_device = transfer_device("gloo")

    def load_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Load a full state dict; returns its bytes."""
        self.rollout.wake_up(["weights"])
        self.rollout.update_weights(state.items())
        return sum(nbytes(tensor) for tensor in state.values())

    def join_weight_transfer(self, meet: Rendezvous, rank: int) -> None:
        """Join a new weight-transfer group as member ``rank`` (1..n; the old group, if any, is dropped)."""
        self._transfer = None
        self._transfer_device = transfer_device(meet.backend)
        self._transfer = open_group(meet, rank)

    def receive_weights(self) -> None:
        """Load the weights the actor's rank 0 broadcasts (``HybridWorker.send_weights``), a bucket at a time."""
        self.rollout.wake_up(["weights"])
        self._receive_into(self.rollout.update_weights)

    def _receive_into(self, load) -> None:
        """One transfer from the actor's rank 0, handed to ``load`` a bucket at a time."""
        assert self._transfer is not None, "receive: join_weight_transfer first"
        named = receive(self._transfer, self._transfer_device)
        try:
            load(named)
        finally:
            drain(named)  # whatever the engine left: the group stays in step

    def load_adapter(self, payload: tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]) -> int:
        """Adapters served unmerged (`HybridWorker.adapter_for_sync`'s (base or None, adapters)): load the
        base when given, then the adapters; returns their bytes."""
        base, adapter = payload
        self.rollout.wake_up(["weights"])
        engine = adapter_engine(self.rollout)
        if base is not None:
            engine.update_weights(base.items())
        engine.update_adapter(adapter.items())
        return sum(nbytes(tensor) for part in (base or {}, adapter) for tensor in part.values())

    def receive_adapter(self, with_base: bool) -> None:
        """`receive_weights` for adapters served unmerged (`HybridWorker.send_adapter`): the base first if
        ``with_base``, then the adapters."""
        self.rollout.wake_up(["weights"])
        engine = adapter_engine(self.rollout)
        for load in ([engine.update_weights] if with_base else []) + [engine.update_adapter]:
            self._receive_into(load)

    def generate(self, batch: Batch, sampling: Sampling | None = None) -> Batch:
        self.rollout.wake_up(["kv_cache"])
        return self.rollout.generate(batch, sampling)

    # ------------------------------------------------------------------ the generation stream
    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        self.rollout.wake_up(["kv_cache"])
        streaming(self.rollout).stream_submit(batch, tag, sampling)

    def stream_advance(self, max_steps: int) -> list[tuple[tuple[int, int], Batch]]:
        return streaming(self.rollout).stream_advance(max_steps)

    def stream_set_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        streaming(self.rollout).stream_set_weights(state.items(), version)

    def stream_cancel(self) -> list[tuple[int, int]]:
        return streaming(self.rollout).stream_cancel()

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()


class CriticHost:
    """The critic of one rank (GAE only) in its own process group, offloaded after each call."""

    def __init__(self, spec: CriticSpec):
        from easyvlm.workers.critic import CriticWorker

        self.rank, self.world_size = init_distributed()
        self.critic = CriticWorker(spec, rank=self.rank, world_size=self.world_size)

    def compute_values(self, batch: Batch) -> Batch:
        out = self.critic.compute_values(batch)
        self.critic.offload()
        return out

    def update_critic(self, batch: Batch) -> dict[str, float]:
        metrics = self.critic.update_critic(batch)
        self.critic.offload()
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.critic.save_checkpoint(f"{path}/critic")

    def load_checkpoint(self, path: str) -> None:
        self.critic.load_checkpoint(f"{path}/critic")


class RewardModelHost:
    """The reward model of one rank (``worker.reward_model``), built in its own process group."""

    def __init__(self, spec: RewardModelSpec):
        from easyvlm.workers.reward_model import RewardModelWorker

        self.rank, self.world_size = init_distributed()
        self.worker = RewardModelWorker(spec, rank=self.rank, world_size=self.world_size)

    def compute_scores(self, batch: Batch) -> Batch:
        return self.worker.compute_scores(batch)
