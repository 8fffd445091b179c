"""The Ray actors of the worker groups other than the hybrid one (``easyvlm.workers.hybrid``): a
rollout engine on its own device, the critic and the reward model. Each is built from its slice of
the run plan, one per rank; the driver's groups (``easyvlm.distributed.worker_group``) call them."""

from __future__ import annotations

import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import streaming
from easyvlm.rollout.factory import build_rollout
from easyvlm.rollout.specs import RolloutSpec, Sampling
from easyvlm.workers.dist import init_distributed
from easyvlm.workers.specs import CriticSpec, RewardModelSpec


class RolloutHost:
    """A rollout engine on its own device (``worker.rollout.placement=separate``): no actor, no
    process group. It samples with the last weights the driver sent (``load_weights``; the driver
    records their version and tags the samples with it). The ``stream_*`` calls are the engine's interruptible generation (partial rollouts,
    ``easyvlm.rollout.base``): groups submitted, advanced a few decoding steps at a time, new
    weights loaded between two steps."""

    def __init__(self, spec: RolloutSpec):
        self.rollout = build_rollout(spec)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.rollout.wake_up(["weights"])
        self.rollout.update_weights(state.items())

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
        """New weights between two decoding steps: the unfinished samples go on with them, each
        token tagged with the version that sampled it."""
        streaming(self.rollout).stream_set_weights(state.items(), version)

    def stream_cancel(self) -> list[tuple[int, int]]:
        return streaming(self.rollout).stream_cancel()

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()


class CriticHost:
    """The critic of one rank (GAE only), built in its own process group. Idle between its calls,
    so it gives its GPU memory back after each as ``worker.critic.offload`` asks."""

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
