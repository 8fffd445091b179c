"""The reference policy (the actor's initial model, without LoRA) for KL penalties (``ref_logprobs``);
with another model, on-policy distillation's teacher (``worker.teacher``, ``teacher_logprobs``)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from easyvlm.data.batch import Batch
from easyvlm.models.ulysses import UlyssesGroup, new_ulysses_group
from easyvlm.workers.specs import RefSpec
from easyvlm.workers.dist import worker_device
from easyvlm.models.moe_routing import routing_state
from easyvlm.workers.forward import ForwardSetup, policy_log_distribution, policy_logprobs_for_batch
from easyvlm.workers.vision_dummy import dummy_image_for
from easyvlm.models.vision_cache import CachedTower, same_frozen_tower
from easyvlm.workers.fsdp import load_model_to, offload_model
from easyvlm.workers.sharded import build_sharded_model
from easyvlm.workers.training import check_worker_group, compute_dtype, model_dtype, token_budget


class RefWorker:
    """The reference model of one rank (rank / world_size of the initialised process group)."""

    def __init__(
        self,
        spec: RefSpec,
        *,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        ulysses: UlyssesGroup | None = None,
        output: str = "ref_logprobs",
        section: str = "worker.ref",
    ):
        """output: the key of the log-probs it returns; section: its config section (error messages)."""
        check_worker_group(rank, world_size)
        self.output = output
        keys = spec.forward.settings  # the actor's padding_free ... expert_parallel_size
        self.ulysses = ulysses if ulysses is not None else new_ulysses_group(keys.ulysses_size)
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        self.model = build_sharded_model(
            spec.model, spec.fsdp, role="policy", dtype=model_dtype(spec.fsdp, self.device, torch.bfloat16),
            padding_free=keys.padding_free, trainable=False, device=self.device, rank=rank, key=f"{section}.fsdp",
            shard_vision_blocks=not spec.forward.vision_cache_mb, expert_parallel_size=keys.expert_parallel_size,
        )
        self.vision = CachedTower(self.model, spec.forward.vision_cache_mb, self.device) if spec.forward.vision_cache_mb else None
        # MoE: the routers' state (R3 replays the sampler's experts here too; workers/routing.py)
        self.setup = ForwardSetup.of(spec.forward, self.device, dummy_image_for(spec.model.hf_config), self.ulysses,
                                     routing=routing_state(self.model), vision_cache=self.vision.cache if self.vision else None)
        self._offloaded = False

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return compute_dtype(self.spec.fsdp, self.device)

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """A new Batch of (B, T) log-probs of ``responses`` (0 at padding) under the key ``output``."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        if self._offloaded:
            load_model_to(self.model, self.device)
            self._offloaded = False
        micro = self.spec.forward.experience
        logprobs, _ = policy_logprobs_for_batch(
            self.model, batch, self.setup, micro_batch_size=micro.micro_batch_size, budget=token_budget(micro, batch),
            with_entropy=False,
        )
        return Batch({self.output: logprobs})

    @torch.no_grad()
    def log_distribution(self, batch: Batch) -> Tensor:
        """(K, V) log-distribution at a micro-batch's K valid response positions, for the full KL."""
        if self._offloaded:
            load_model_to(self.model, self.device)
            self._offloaded = False
        self.model.eval()
        return policy_log_distribution(self.model, batch, self.setup)

    def offload(self) -> None:
        """Move the weights to host memory if ``<section>.offload.offload_params`` (no-op on the CPU)."""
        if self.spec.offload.offload_params:
            offload_model(self.model)
            self._offloaded = True
            if self.vision is not None:
                self.vision.cache.clear()

    def share_vision_cache(self, actor_vision: CachedTower, actor_model: torch.nn.Module,
                           actor_dtype: torch.dtype | None) -> bool:
        """Serve this model's images from the actor's cache when the two towers compute alike; returns whether shared."""
        if self.vision is None or not same_frozen_tower(actor_model, actor_dtype, self.model, self.compute_dtype):
            return False
        self.vision.share(actor_vision)
        self.setup = dataclasses.replace(self.setup, vision_cache=actor_vision.cache)
        return True
