"""The hybrid engine: actor, rollout engine, reference model and teacher share one process per
device; the actor's weights are loaded into the engine before generation, and the roles offload and
sleep in turn (no-ops on the CPU)."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from easyvlm.data.batch import Batch
from easyvlm.models.ulysses import new_ulysses_group
from easyvlm.rollout.specs import RolloutSpec, Sampling
from easyvlm.workers.specs import ActorSpec, RefSpec
from easyvlm.rollout.base import adapter_engine
from easyvlm.rollout.factory import build_rollout
from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.dist import default_backend, init_distributed
from easyvlm.workers.fsdp import iter_lora_adapter, iter_lora_base_state_dict
from easyvlm.workers.ref import RefWorker
from easyvlm.workers.training import compute_dtype
from easyvlm.workers.weight_transfer import SENDER, Rendezvous, drain, open_group, send, transfer_device


# A generate() output's meta key when the call synced weights: the bytes one engine took (every rank's
# engine takes the same); the driver reports it as a metric of the step
WEIGHT_SYNC_BYTES = "perf/weight_sync_bytes"


class ByteCount:
    """Counts the bytes of the tensors a weight sync's stream hands on."""

    def __init__(self):
        self.bytes = 0

    def through(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class HybridWorker:
    """rollout: None when the engines live in their own group (``placement=separate``,
    `easyvlm.workers.hosts.RolloutHost`), which the driver sends ``weights_for_sync()``."""

    def __init__(self, actor: ActorSpec, ref: Optional[RefSpec], rollout: Optional[RolloutSpec],
                 teacher: Optional[RefSpec] = None):
        self.rank, self.world_size = init_distributed()
        ulysses = new_ulysses_group(actor.forward.settings.ulysses_size)  # the reference model follows the actor's
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
        # LoRA served unmerged (EngineSpec.lora): the base weights go to the engine at the first sync only
        self.serves_adapter = rollout is not None and rollout.engine.lora is not None
        self._base_synced = False
        self._transfer = None  # rank 0's end of the separate engines' weight-transfer group, once joined
        self._transfer_device = transfer_device("gloo")

    # ------------------------------------------------------------------ rollout
    def generate(self, batch: Batch, sampling: Sampling | None = None, sync_weights: bool = True) -> Batch:
        """Sample responses (``sampling`` None: the plan's training sampling), after loading the actor's
        current weights into the engine when ``sync_weights``."""
        assert self.rollout is not None, "generate: the rollout engines are a separate group (worker.rollout.placement)"
        sent = self.push_weights() if sync_weights else None
        self.actor.offload()  # idle until the next log-prob pass (GPU memory for the KV cache)
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                frozen.offload()
        self.rollout.wake_up(["kv_cache"])
        out = self.rollout.generate(batch, sampling)
        self.rollout.sleep()
        if sent is not None:
            out.meta[WEIGHT_SYNC_BYTES] = float(sent)
        return out

    def push_weights(self) -> int:
        """Load the actor's weights into the engine a tensor at a time: the whole model (LoRA merged), or
        with adapters served unmerged the base once, then the adapters. Returns the bytes. Collective."""
        self.rollout.wake_up(["weights"])
        device = self.rollout.weight_sync_device
        sent = ByteCount()
        if not self.serves_adapter:
            self.rollout.update_weights(sent.through(self.actor.iter_weights_for_sync(device)))
            return sent.bytes
        engine = adapter_engine(self.rollout)
        self.actor.trained.ensure_loaded()
        if not self._base_synced:
            engine.update_weights(sent.through(iter_lora_base_state_dict(self.actor.model, device)))
            self._base_synced = True
        engine.update_adapter(sent.through(iter_lora_adapter(self.actor.model, device)))
        return sent.bytes

    def weights_for_sync(self) -> dict[str, torch.Tensor] | None:
        """The actor's full weights (CPU, transformers names) on rank 0, None elsewhere. Collective."""
        state = self.actor.state_dict_for_sync()
        return state if self.rank == 0 else None

    def adapter_for_sync(self, with_base: bool) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]] | None:
        """Adapters served unmerged by separate engines: (the base weights if ``with_base``, the adapters),
        CPU, on rank 0; None elsewhere. Collective."""
        self.actor.trained.ensure_loaded()
        base = dict(iter_lora_base_state_dict(self.actor.model, "cpu")) if with_base else None
        adapter = dict(iter_lora_adapter(self.actor.model, "cpu"))
        return (base, adapter) if self.rank == 0 else None

    # ------------------------------------------------------------------ separate engines: the collective
    @staticmethod
    def transfer_backend() -> str:
        """The weight-transfer group's backend: this rank's."""
        return default_backend()

    def join_weight_transfer(self, meet: Rendezvous) -> None:
        """Rank 0: join a new weight-transfer group as its sender (the old one, if any, is dropped)."""
        assert self.rank == 0, "join_weight_transfer: only the actor's rank 0 sends the weights"
        self._transfer = None
        self._transfer_device = transfer_device(meet.backend)
        self._transfer = open_group(meet, SENDER)

    def send_weights(self, bucket_bytes: int) -> int:
        """Broadcast the actor's full weights to the separate engines in buckets from rank 0; returns the
        bytes sent (0 off rank 0). Collective over both groups."""
        return self._send(self.actor.iter_weights_for_sync(self._transfer_device), bucket_bytes)

    def _send(self, named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        """One transfer of ``named`` from rank 0; the other ranks only take part in the gather. Returns the bytes."""
        if self.rank != 0:
            drain(named)
            return 0
        assert self._transfer is not None, "send: join_weight_transfer first"
        try:
            return send(self._transfer, named, bucket_bytes, self._transfer_device)
        except BaseException:
            drain(named)  # the other ranks finish their gather instead of waiting on rank 0
            raise

    def send_adapter(self, bucket_bytes: int, with_base: bool) -> int:
        """`send_weights` for adapters served unmerged: the base weights first if ``with_base`` (a group just
        formed: its engines may be new), then the adapters, two transfers. Collective over both groups."""
        self.actor.trained.ensure_loaded()
        parts = [iter_lora_base_state_dict] if with_base else []
        return sum(self._send(part(self.actor.model, self._transfer_device), bucket_bytes)
                   for part in (*parts, iter_lora_adapter))

    # ------------------------------------------------------------------ experience and update
    def compute_logprobs(self, batch: Batch) -> Batch:
        return self.actor.compute_logprobs(batch, with_entropy=False)

    def compute_ref_logprobs(self, batch: Batch, full_kl: bool = False) -> Batch:
        """``ref_logprobs`` (B, T); with ``full_kl`` also ``ref_kl`` (B, T), the per-token KL(pi || pi_ref)."""
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
