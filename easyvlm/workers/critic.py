"""The critic: a value model under FSDP2 for GAE (``values``) and its clipped value-loss update.

The model is ``AutoModelForTokenClassification(num_labels=1)`` when transformers has one for the
architecture (Qwen2/3, Llama), else ``models.loading.ValueHeadModel`` (the backbone, e.g.
``Qwen2_5_VLModel``, plus a Linear(H, 1) head): transformers has no token-classification class
for Qwen2-VL / Qwen2.5-VL. The value of response token t is the output at position P - 1 + t, the
state before the token is generated (as EasyR1 and verl read it).

Update: ``ppo_epochs`` x mini-batches x micro-batches with the same global normalisation,
clipping and non-finite skipping as the actor (see ``workers/actor.py``), with
``algorithms.value_loss.value_loss``.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import loss_normalizer
from easyvlm.algorithms.value_loss import value_loss
from easyvlm.data.batch import Batch
from easyvlm.models.loading import load_model
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import dummy_image_for, micro_batches, outputs_with_vision, scatter_response
from easyvlm.workers.fsdp import apply_fsdp, load_model_to, load_optimizer_to, offload_model, offload_optimizer
from easyvlm.workers.optim import build_optimizer, build_scheduler, step_scheduler
from easyvlm.workers.training import (
    all_reduce_sums,
    check_same_batch_size,
    check_supported,
    check_worker_group,
    clip_and_step,
    equalize_micro_batches,
    load_sharded_checkpoint,
    model_dtype,
    per_rank_batch_size,
    save_sharded_checkpoint,
    token_budget,
)

logger = logging.getLogger(__name__)


class CriticWorker:
    """The value model of one rank.

    Args: ``config`` = ``worker.critic`` (CriticConfig); rank / world_size of the initialised
    process group; ``total_steps`` for the LR schedule; ``rollout_n`` (mini-batch =
    ``global_batch_size * rollout_n`` samples); ``max_response_length`` for
    "seq-mean-token-sum-norm"; ``seed`` for the value head's initial weights (same on all ranks).
    """

    def __init__(
        self,
        config: Any,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        rollout_n: int = 1,
        max_response_length: int | None = None,
        seed: int = 1,
        device: torch.device | None = None,
    ):
        check_worker_group(rank, world_size)
        check_supported(config, "worker.critic")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        self.max_response_length = max_response_length
        self.mini_batch_size = per_rank_batch_size(
            config.global_batch_size, rollout_n, world_size, "worker.critic.global_batch_size"
        )
        torch.manual_seed(seed)  # the new value head gets the same initial weights on every rank
        loaded = load_model(
            config.model,
            role="critic",
            dtype=model_dtype(config.fsdp, self.device, torch.float32),
            padding_free=config.padding_free,
        )
        self.hf_config = loaded.hf_config
        self.dummy_image = dummy_image_for(self.hf_config)
        self.model = apply_fsdp(loaded.model, config.fsdp, self.device)
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self._offloaded = False

    def _values(self, batch: Batch) -> Tensor:
        """(B, T) values of the states before each response token (0 at padding)."""
        out, valid = outputs_with_vision(
            self.model, batch, padding_free=self.config.padding_free, share_prompts=self.config.share_prompts,
            device=self.device, dummy_image=self.dummy_image, lm_head=False,
        )  # (K, 1)
        return scatter_response(out[:, 0].float(), valid)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, T). Inputs as ``ActorWorker.compute_logprobs``; returns a new Batch."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        self._ensure_loaded()
        self.model.eval()
        size = self.config.micro_batch_size_per_device_for_experience
        micros = equalize_micro_batches(micro_batches(batch, size, token_budget(self.config, size, batch)), self.device)
        values = []
        for micro, is_dummy in micros:
            micro_values = self._values(micro)  # a dummy runs too: every rank makes the same FSDP calls
            if not is_dummy:
                values.append(micro_values.cpu())
        return Batch({"values": torch.cat(values)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss updates; batch needs ``values`` (old), ``returns``, ``response_mask``
        (B, T) besides the forward inputs. Metrics: critic/vf_loss, critic/vf_clipfrac,
        critic/vpred_mean, critic/grad_norm, critic/lr, critic/skipped_steps."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns")
        check_same_batch_size(len(batch), self.device, "CriticWorker.update_critic")
        self._ensure_loaded()
        self.model.train()
        cfg = self.config
        history: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(self.mini_batch_size):
                local_n = loss_normalizer(mini["response_mask"].bool(), cfg.loss_avg_mode, self.max_response_length)
                normalizer = all_reduce_sums({"n": local_n}, self.device)["n"]
                size = cfg.micro_batch_size_per_device_for_update
                acc: dict[str, float] = defaultdict(float, nonfinite=0.0)  # same keys on every rank
                micros = micro_batches(mini, size, token_budget(cfg, size, mini))
                for micro, is_dummy in equalize_micro_batches(micros, self.device):
                    weight = 0.0 if is_dummy else 1.0
                    mask = micro["response_mask"].to(self.device).bool()
                    loss, metrics = value_loss(
                        self._values(micro),
                        micro["values"].to(self.device),
                        micro["returns"].to(self.device),
                        mask,
                        cfg.cliprange_value,
                        cfg.loss_avg_mode,
                        normalizer,
                    )
                    if not torch.isfinite(loss.detach()):
                        acc["nonfinite"] += 1.0
                    (loss * (weight * self.world_size)).backward()
                    acc["critic/vf_loss"] += weight * loss.item()
                    tokens = weight * float(mask.sum())
                    acc["tokens"] += tokens
                    for key, value in metrics.items():
                        acc[f"critic/{key}"] += tokens * float(value)
                totals = all_reduce_sums(acc, self.device)
                nonfinite = totals["nonfinite"] > 0
                grad_norm, stepped = clip_and_step(self.model, self.optimizer, cfg.max_grad_norm, nonfinite)
                history["critic/vf_loss"].append(totals["critic/vf_loss"])
                for key, value in totals.items():
                    if key.startswith("critic/") and key != "critic/vf_loss":
                        history[key].append(value / max(totals["tokens"], 1.0))
                if stepped:
                    history["critic/grad_norm"].append(grad_norm)
                else:
                    skipped += 1
                    logger.warning("critic: skipped an optimizer step (non-finite loss or grad norm %s)", grad_norm)
        metrics = {key: float(np.mean(values)) for key, values in history.items()}
        metrics.setdefault("critic/grad_norm", float("nan"))
        metrics["critic/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["critic/skipped_steps"] = float(skipped)
        step_scheduler(self.scheduler)
        return metrics

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        self._ensure_loaded()
        save_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, self.rank)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self._ensure_loaded()
        load_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, self.rank)

    def offload(self) -> None:
        """Free the GPU between phases as ``worker.critic.offload`` asks (no-op on the CPU)."""
        if self.config.offload.offload_params:
            offload_model(self.model)
        if self.config.offload.offload_optimizer:
            offload_optimizer(self.optimizer)
        self._offloaded = True

    def _ensure_loaded(self) -> None:
        if self._offloaded:
            load_model_to(self.model, self.device)
            load_optimizer_to(self.optimizer, self.device)
            self._offloaded = False
