"""The critic: a value model under FSDP2 for GAE (``values``) and its clipped value-loss update. The
value of response token t is read at position P - 1 + t, the state before it (as in EasyR1 and verl)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from easyvlm.algorithms.value_losses import value_loss
from easyvlm.data.batch import Batch
from easyvlm.models.ulysses import loss_scale, new_ulysses_group
from easyvlm.workers.specs import CriticSpec
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import ForwardSetup, micro_batches, outputs_with_vision, scatter_response
from easyvlm.workers.vision_dummy import dummy_image_for
from easyvlm.workers.sharded import build_sharded_model
from easyvlm.workers.training import check_worker_group, equalize_micro_batches, model_dtype, token_budget
from easyvlm.workers.update import MicroLoss, TrainedModel


class CriticWorker:
    """The value model of one rank (rank / world_size of the initialised process group)."""

    def __init__(self, spec: CriticSpec, *, rank: int, world_size: int, device: torch.device | None = None):
        check_worker_group(rank, world_size)
        keys = spec.forward.settings  # worker.critic.padding_free ... expert_parallel_size
        self.ulysses = new_ulysses_group(keys.ulysses_size)  # collective
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        torch.manual_seed(spec.seed)  # the new value head gets the same initial weights on every rank
        self.model = build_sharded_model(
            spec.model, spec.fsdp, role="critic", dtype=model_dtype(spec.fsdp, self.device, torch.float32),
            padding_free=keys.padding_free, trainable=True, device=self.device, rank=rank, key="worker.critic.fsdp",
            expert_parallel_size=keys.expert_parallel_size,
        )
        self.setup = ForwardSetup.of(spec.forward, self.device, dummy_image_for(spec.model.hf_config), self.ulysses)
        scale = loss_scale(world_size, keys.ulysses_size)  # see models/ulysses.py
        self.trained = TrainedModel(self.model, spec.update, spec.offload, self.device, "critic", grad_scale=scale,
                                    loss_avg_mode=spec.value_loss.loss_avg_mode)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trained.optimizer

    def _values(self, batch: Batch) -> Tensor:
        """(B, T) values of the states before each response token (0 at padding)."""
        out, valid = outputs_with_vision(self.model, batch, self.setup, lm_head=False)  # (K, 1)
        return scatter_response(out[:, 0].float(), valid)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, T). Inputs as ``ActorWorker.compute_logprobs``; returns a new Batch."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        self.trained.ensure_loaded()
        self.model.eval()
        micro = self.spec.forward.experience
        micros = equalize_micro_batches(micro_batches(batch, micro.micro_batch_size, token_budget(micro, batch)), self.device)
        values = []
        for chunk, is_dummy in micros:
            chunk_values = self._values(chunk)  # a dummy runs too: every rank makes the same FSDP calls
            if not is_dummy:
                values.append(chunk_values.cpu())
        return Batch({"values": torch.cat(values)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss updates; batch needs ``values`` (old), ``returns``, ``response_mask`` (B, T)
        besides the forward inputs. Returns critic/* metrics (docs/workers.md, "The update")."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns")
        return self.trained.update(batch, self._micro_loss)

    def _micro_loss(self, micro: Batch, normalizer: float) -> MicroLoss:
        mask = micro["response_mask"].to(self.device).bool()
        loss, metrics = value_loss(
            self._values(micro),
            micro["values"].to(self.device),
            micro["returns"].to(self.device),
            mask,
            self.spec.value_loss.cliprange_value,
            self.spec.value_loss.loss_avg_mode,
            normalizer,
        )
        return MicroLoss(loss=loss, tokens=float(mask.sum()), sums={"vf_loss": loss.item()}, token_means=dict(metrics))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        self.trained.save(path, self.rank)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self.trained.load(path, self.rank)

    def offload(self) -> None:
        """Free the GPU between phases as ``worker.critic.offload`` asks (no-op on the CPU)."""
        self.trained.offload()
