"""One update loop for every trained role (actor, critic; they differ only in the loss), and what both
save, load and offload. The steps: docs/workers.md, "The update"."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from easyvlm.algorithms.aggregation import loss_normalizer
from easyvlm.workers.settings import OffloadConfig
from easyvlm.data.batch import Batch
from easyvlm.workers.specs import UpdateSpec
from easyvlm.workers.forward import micro_batches
from easyvlm.workers.fsdp import load_model_to, load_optimizer_to, offload_model, offload_optimizer
from easyvlm.workers.optim import build_optimizer, build_scheduler, step_scheduler
from easyvlm.workers.training import (
    all_reduce_sums,
    check_same_batch_size,
    clip_and_step,
    equalize_micro_batches,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    token_budget,
)

logger = logging.getLogger(__name__)


@dataclass
class MicroLoss:
    """What a role's loss returns for one micro-batch."""

    loss: Tensor
    """Scalar with grad, already aggregated with the mini-batch normaliser N."""
    tokens: float
    """Valid response tokens of the micro-batch (the weight of its ``token_means``)."""
    sums: dict[str, float] = field(default_factory=dict)
    """Metrics that add up over micro-batches to the mini-batch value (loss terms divided by N)."""
    token_means: dict[str, float] = field(default_factory=dict)


MicroLossFn = Callable[[Batch, float], MicroLoss]


class TrainedModel:
    """A sharded model with its optimizer and learning-rate schedule. prefix: the metric prefix.
    grad_scale: the factor on each micro-batch loss (world size: FSDP averages gradients).
    loss_avg_mode: the role's loss's aggregation, which the mini-batch normaliser follows."""

    def __init__(self, model: nn.Module, update: UpdateSpec, offload: OffloadConfig, device: torch.device,
                 prefix: str, grad_scale: float, loss_avg_mode: str):
        assert update.total_steps > 0, "set UpdateSpec.total_steps (easyvlm.plan.roles.with_total_steps)"
        self.model = model
        self.spec = update
        self.offload_spec = offload
        self.device = device
        self.prefix = prefix
        self.grad_scale = grad_scale
        self.loss_avg_mode = loss_avg_mode
        self.optimizer = build_optimizer(model.parameters(), update.optim)
        self.scheduler = build_scheduler(self.optimizer, update.optim, update.total_steps)
        self._offloaded = False

    # ------------------------------------------------------------------ update
    def update(self, batch: Batch, micro_loss: MicroLossFn) -> dict[str, float]:
        """Epochs x mini-batches x micro-batches over this rank's samples; returns the step's metrics, the
        same on every rank (``<prefix>/grad_norm``, ``/lr``, ``/skipped_steps`` and the role's own)."""
        check_same_batch_size(len(batch), self.device, f"{self.prefix} update")
        self.ensure_loaded()
        self.model.train()
        history: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(self.spec.settings.ppo_epochs):
            for mini in batch.split(self.spec.mini_batch_per_rank):
                stats, grad_norm, stepped = self._mini_batch(mini, micro_loss)
                for key, value in stats.items():
                    history[key].append(value)
                if stepped:
                    history[f"{self.prefix}/grad_norm"].append(grad_norm)
                else:
                    skipped += 1
                    logger.warning("%s: skipped an optimizer step (non-finite loss or grad norm %s)", self.prefix, grad_norm)
        metrics = {key: float(np.mean(values)) for key, values in history.items()}
        metrics.setdefault(f"{self.prefix}/grad_norm", float("nan"))
        metrics[f"{self.prefix}/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics[f"{self.prefix}/skipped_steps"] = float(skipped)
        step_scheduler(self.scheduler)
        return metrics

    def _mini_batch(self, mini: Batch, micro_loss: MicroLossFn) -> tuple[dict[str, float], float, bool]:
        spec = self.spec
        local_n = loss_normalizer(mini["response_mask"].bool(), self.loss_avg_mode, spec.norm_length)
        normalizer = all_reduce_sums({"n": local_n}, self.device)["n"]
        size = spec.micro.micro_batch_size
        micros = equalize_micro_batches(micro_batches(mini, size, token_budget(spec.micro, mini)), self.device)
        acc: dict[str, float] = defaultdict(float, nonfinite=0.0, tokens=0.0)  # same keys on every rank
        sum_keys: set[str] = set()
        for micro, is_dummy in micros:
            weight = 0.0 if is_dummy else 1.0  # a dummy runs too (FSDP's collectives), weighted 0
            out = micro_loss(micro, normalizer)
            if not torch.isfinite(out.loss.detach()):
                acc["nonfinite"] += 1.0
            (out.loss * (weight * self.grad_scale)).backward()
            tokens = weight * out.tokens
            acc["tokens"] += tokens
            for key, value in out.sums.items():
                acc[f"{self.prefix}/{key}"] += weight * value
                sum_keys.add(f"{self.prefix}/{key}")
            for key, value in out.token_means.items():
                acc[f"{self.prefix}/{key}"] += tokens * value
        totals = all_reduce_sums(acc, self.device)
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, spec.settings.max_grad_norm,
                                           totals["nonfinite"] > 0)
        stats = {}
        for key, value in totals.items():
            if key in sum_keys:
                stats[key] = value  # loss terms already divided by the global normaliser: the sum is the mini-batch's
            elif key.startswith(f"{self.prefix}/"):
                stats[key] = value / max(totals["tokens"], 1.0)  # token means over the mini-batch
        return stats, grad_norm, stepped

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike, rank: int) -> None:
        """Model + optimizer (sharded, torch.distributed.checkpoint), schedule and RNG per rank. Collective."""
        self.ensure_loaded()
        save_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, rank)

    def load(self, path: str | os.PathLike, rank: int) -> None:
        """Restore what :meth:`save` wrote (same world size). Collective."""
        self.ensure_loaded()
        load_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, rank)

    # ------------------------------------------------------------------ offload (GPU only)
    def offload(self) -> None:
        """Move what ``offload`` asks for to host memory while the role is idle (no-op on the CPU)."""
        if self.offload_spec.offload_params:
            offload_model(self.model)
        if self.offload_spec.offload_optimizer:
            offload_optimizer(self.optimizer)
        self._offloaded = True

    def ensure_loaded(self) -> None:
        if self._offloaded:
            load_model_to(self.model, self.device)
            load_optimizer_to(self.optimizer, self.device)
            self._offloaded = False
