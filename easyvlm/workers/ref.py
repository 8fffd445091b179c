"""The reference policy: a frozen copy of the initial policy, for KL penalties (``ref_logprobs``).

It loads ``worker.actor.model`` without LoRA adapters (with LoRA the base weights are the initial
policy) and follows the actor's micro-batch size, dynamic batching and padding-free settings;
``worker.ref`` only gives its FSDP and offload settings (EasyR1's layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from easyvlm.data.batch import Batch
from easyvlm.models.loading import load_model
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import dummy_image_for, policy_logprobs_for_batch
from easyvlm.workers.fsdp import apply_fsdp, load_model_to, offload_model
from easyvlm.workers.training import check_worker_group, model_dtype, token_budget


class RefWorker:
    """Args: ``config`` = ``worker.ref`` (RefConfig), ``actor_config`` = ``worker.actor``;
    rank / world_size of the initialised process group; ``temperature``: the rollout's."""

    def __init__(
        self,
        config: Any,
        actor_config: Any,
        *,
        rank: int,
        world_size: int,
        temperature: float = 1.0,
        device: torch.device | None = None,
    ):
        check_worker_group(rank, world_size)
        self.config = config
        self.actor_config = actor_config
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        self.temperature = float(temperature)
        model_config = actor_config.model
        if getattr(model_config.lora, "rank", 0) > 0:
            model_config = dataclasses.replace(model_config, lora=dataclasses.replace(model_config.lora, rank=0))
        loaded = load_model(
            model_config,
            role="policy",
            dtype=model_dtype(config.fsdp, self.device, torch.bfloat16),
            padding_free=actor_config.padding_free,
            trainable=False,
        )
        self.model = apply_fsdp(loaded.model, config.fsdp, self.device)
        self.dummy_image = dummy_image_for(loaded.hf_config)
        self._offloaded = False

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """``ref_logprobs`` (B, T) of ``responses`` under the reference policy (0 at padding).

        Same inputs as ``ActorWorker.compute_logprobs``; returns a new Batch with only that key.
        """
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        if self._offloaded:
            load_model_to(self.model, self.device)
            self._offloaded = False
        size = self.actor_config.micro_batch_size_per_device_for_experience
        logprobs, _ = policy_logprobs_for_batch(
            self.model, batch, micro_batch_size=size, budget=token_budget(self.actor_config, size, batch),
            temperature=self.temperature, with_entropy=False, padding_free=self.actor_config.padding_free,
            share_prompts=self.actor_config.share_prompts, device=self.device, dummy_image=self.dummy_image,
        )
        return Batch({"ref_logprobs": logprobs})

    def offload(self) -> None:
        """Move the weights to CPU memory if ``worker.ref.offload.offload_params`` (GPU only)."""
        if self.config.offload.offload_params:
            offload_model(self.model)
            self._offloaded = True
