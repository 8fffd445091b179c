"""The hybrid engine: actor, rollout engine and reference model (and a distillation teacher) share one
process per device.

One Ray actor per device holds all three (composition, not a class per role combination), each built
from its slice of the run plan. Before every generation the actor's current weights are loaded into
the rollout engine, so vLLM samples from exactly the policy that trains. Then, while the engine
generates, the actor and the reference model give their GPU memory back as ``worker.*.offload``
asks, and the engine sleeps while they work; on the CPU all of these are no-ops.
"""

from __future__ import annotations

from typing import Optional

import torch

from easyvlm.data.batch import Batch
from easyvlm.models.ulysses import new_ulysses_group
from easyvlm.rollout.specs import RolloutSpec, Sampling
from easyvlm.workers.specs import ActorSpec, RefSpec
from easyvlm.rollout.factory import build_rollout
from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.dist import init_distributed
from easyvlm.workers.ref import RefWorker
from easyvlm.workers.training import compute_dtype


class HybridWorker:
    """rollout: None when the engines live in their own group (``worker.rollout.placement=separate``,
    `easyvlm.workers.hosts.RolloutHost`); then the driver sends them ``weights_for_sync()`` after
    each update."""

    def __init__(self, actor: ActorSpec, ref: Optional[RefSpec], rollout: Optional[RolloutSpec],
                 teacher: Optional[RefSpec] = None):
        self.rank, self.world_size = init_distributed()
        ulysses = new_ulysses_group(actor.forward.ulysses_size)  # the reference model follows the actor's
        self.actor = ActorWorker(actor, rank=self.rank, world_size=self.world_size, ulysses=ulysses)
        self.ref = RefWorker(ref, rank=self.rank, world_size=self.world_size, ulysses=ulysses) if ref is not None else None
        if self.ref is not None:
            self.actor.reference_distribution = self.ref.log_distribution  # the full KL's, in-process
            if self.actor.vision is not None:  # the reference's tower is the actor's frozen one: no second encode
                self.ref.share_vision_cache(self.actor.vision, self.actor.model, compute_dtype(actor.fsdp, self.actor.device))
        self.teacher = RefWorker(teacher, rank=self.rank, world_size=self.world_size, ulysses=ulysses,
                                 output="teacher_logprobs", section="worker.teacher") if teacher is not None else None
        if self.teacher is not None:
            self.actor.teacher_distribution = self.teacher.log_distribution  # distill_full_kl's, in-process
        self.rollout = build_rollout(rollout) if rollout is not None else None

    # ------------------------------------------------------------------ rollout
    def generate(self, batch: Batch, sampling: Sampling | None = None, sync_weights: bool = True) -> Batch:
        """Sample responses with the actor's current weights, loaded into the engine first when
        ``sync_weights`` (the driver's rollout service knows which version the engines hold).
        sampling: None = the plan's training sampling (e.g. the plan's validation sampling)."""
        assert self.rollout is not None, "generate: the rollout engines are a separate group (worker.rollout.placement)"
        if sync_weights:
            self.rollout.wake_up(["weights"])
            # a tensor at a time, on the device the engine takes them on (its own GPU: no host round trip)
            self.rollout.update_weights(self.actor.iter_weights_for_sync(self.rollout.weight_sync_device))
        self.actor.offload()  # idle until the next log-prob pass (GPU memory for the KV cache)
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                frozen.offload()
        self.rollout.wake_up(["kv_cache"])
        out = self.rollout.generate(batch, sampling)
        self.rollout.sleep()
        return out

    def weights_for_sync(self) -> dict[str, torch.Tensor] | None:
        """The actor's full weights (CPU, transformers names) on rank 0, None elsewhere: for the separate
        rollout group. Collective: call it on every rank."""
        state = self.actor.state_dict_for_sync()
        return state if self.rank == 0 else None

    # ------------------------------------------------------------------ experience and update
    def compute_logprobs(self, batch: Batch) -> Batch:
        return self.actor.compute_logprobs(batch, with_entropy=False)

    def compute_ref_logprobs(self, batch: Batch, full_kl: bool = False) -> Batch:
        """``ref_logprobs`` (B, T); with ``full_kl`` also ``ref_kl`` (B, T): KL(pi || pi_ref) over the
        vocabulary per token under the actor's current weights (the full KL in the reward)."""
        assert self.ref is not None, "compute_ref_logprobs: the plan has no reference model (algorithm.disable_kl)"
        out = self.ref.compute_ref_logprobs(batch)
        if full_kl:
            out["ref_kl"] = self.actor.full_kl(batch, self.ref.log_distribution)
        return out

    def compute_teacher_logprobs(self, batch: Batch) -> Batch:
        """``teacher_logprobs`` (B, T): on-policy distillation's teacher on the student's samples."""
        assert self.teacher is not None, "compute_teacher_logprobs: the plan has no teacher (worker.teacher)"
        return self.teacher.compute_ref_logprobs(batch)

    def update_actor(self, batch: Batch, entropy_coeff: float | None = None) -> dict[str, float]:
        """``entropy_coeff``: the driver's adaptive entropy coefficient for this update (None: the spec's)."""
        return self.actor.update_policy(batch, entropy_coeff)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, export_hf: bool) -> None:
        self.actor.save_checkpoint(f"{path}/actor")
        if export_hf:
            self.actor.export_hf(f"{path}/actor/huggingface")

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(f"{path}/actor")

    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()
