"""The reward model worker: a frozen scalar reward model under FSDP2 scoring whole sequences at their
last attended token (:func:`sequence_scores`, shared with easyvlm.rm)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.workers.specs import RewardModelSpec
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import ForwardSetup, micro_batches, outputs_with_vision
from easyvlm.workers.vision_dummy import dummy_image_for
from easyvlm.workers.sharded import build_sharded_model
from easyvlm.workers.training import check_worker_group, equalize_micro_batches, model_dtype


def sequence_scores(model: nn.Module, batch: Batch, setup: ForwardSetup) -> Tensor:
    """(B,) float32 scores of ``batch``'s rows (the critic's forward inputs), with grad when enabled."""
    out, _ = outputs_with_vision(model, batch, setup, lm_head=False, at_last_token=True)  # (B, 1)
    return out[:, 0].float()


class RewardModelWorker:
    """The reward model of one rank (rank / world_size of the initialised process group)."""

    def __init__(self, spec: RewardModelSpec, *, rank: int, world_size: int, device: torch.device | None = None):
        check_worker_group(rank, world_size)
        self.spec = spec
        self.device = device or worker_device()
        self.model = build_sharded_model(
            spec.model, spec.fsdp, role="reward", dtype=model_dtype(spec.fsdp, self.device, torch.bfloat16),
            padding_free=spec.forward.settings.padding_free, trainable=False, device=self.device, rank=rank,
            key="worker.reward_model.fsdp",
        )
        self.model.eval()
        self.setup = ForwardSetup.of(spec.forward, self.device, dummy_image_for(spec.model.hf_config), None)

    @torch.no_grad()
    def compute_scores(self, batch: Batch) -> Batch:
        """``rm_scores`` (B,) of prompt + response rows (the critic's forward inputs)."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        micros = equalize_micro_batches(micro_batches(batch, self.spec.forward.experience.micro_batch_size), self.device)
        scores = []
        for chunk, is_dummy in micros:
            chunk_scores = sequence_scores(self.model, chunk, self.setup)  # a dummy runs too (FSDP's collectives)
            if not is_dummy:
                scores.append(chunk_scores.cpu())
        return Batch({"rm_scores": torch.cat(scores)})
