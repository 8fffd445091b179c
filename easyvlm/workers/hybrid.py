"""The hybrid engine: actor, rollout engine and reference model share one process per device.

One Ray actor per device holds all three (composition, not a class per role combination). Before
every generation the actor's current weights are loaded into the rollout engine, so vLLM samples
from exactly the policy that trains. On GPUs the engine sleeps while the actor trains (its memory
is handed back) and wakes before the next sync; on the CPU these are no-ops.
"""

from __future__ import annotations

from typing import Any

import torch

from easyvlm.data.batch import Batch
from easyvlm.models.builtin import resolve_model_path
from easyvlm.rollout.factory import build_rollout
from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.dist import init_distributed
from easyvlm.workers.ref import RefWorker


class HybridWorker:
    def __init__(self, cfg: Any, total_steps: int, use_reference: bool, device: str):
        from transformers import AutoTokenizer

        from easyvlm.data.images import vllm_mm_processor_kwargs

        self.rank, self.world_size = init_distributed()
        actor_cfg, rollout_cfg, data_cfg = cfg.worker.actor, cfg.worker.rollout, cfg.data
        self.actor = ActorWorker(
            actor_cfg,
            rank=self.rank,
            world_size=self.world_size,
            total_steps=total_steps,
            rollout_n=rollout_cfg.n,
            temperature=rollout_cfg.temperature,
            algorithm=cfg.algorithm,
            max_response_length=data_cfg.max_response_length,
            seed=cfg.trainer.seed,
        )
        self.ref = (
            RefWorker(cfg.worker.ref, actor_cfg, rank=self.rank, world_size=self.world_size, temperature=rollout_cfg.temperature)
            if use_reference
            else None
        )
        model_path = resolve_model_path(actor_cfg.model.model_path)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(actor_cfg.model.tokenizer_path or actor_cfg.model.model_path))
        self.rollout = build_rollout(
            rollout_cfg,
            model_path,
            tokenizer,
            data_cfg.max_prompt_length,
            data_cfg.max_response_length,
            device=device,
            mm_processor_kwargs=vllm_mm_processor_kwargs(data_cfg.min_pixels, data_cfg.max_pixels),
        )
        self._policy_version = 0  # bumped by every actor update
        self._synced_version = -1  # the version the rollout engine holds

    # ------------------------------------------------------------------ rollout
    def generate(self, batch: Batch, **overrides: Any) -> Batch:
        """Sample responses with the actor's current weights (synced first if they changed)."""
        if self._synced_version != self._policy_version:
            self.rollout.wake_up(["weights"])
            self.rollout.update_weights(self.actor.state_dict_for_sync().items())
            self._synced_version = self._policy_version
        self.rollout.wake_up(["kv_cache"])
        out = self.rollout.generate(batch, **overrides)
        self.rollout.sleep()
        return out

    # ------------------------------------------------------------------ experience and update
    def compute_logprobs(self, batch: Batch) -> Batch:
        return self.actor.compute_logprobs(batch, with_entropy=False)

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("compute_ref_logprobs: no reference model (algorithm.disable_kl is true)")
        return self.ref.compute_ref_logprobs(batch)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        metrics = self.actor.update_policy(batch)
        self._policy_version += 1
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, export_hf: bool) -> None:
        self.actor.save_checkpoint(f"{path}/actor")
        if export_hf:
            self.actor.export_hf(f"{path}/actor/huggingface")

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(f"{path}/actor")
        self._policy_version += 1  # force a weight sync before the next generation

    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()


class CriticHost:
    """The critic of one rank (GAE only), built in its own process group."""

    def __init__(self, cfg: Any, total_steps: int):
        from easyvlm.workers.critic import CriticWorker

        self.rank, self.world_size = init_distributed()
        self.critic = CriticWorker(
            cfg.worker.critic,
            rank=self.rank,
            world_size=self.world_size,
            total_steps=total_steps,
            rollout_n=cfg.worker.rollout.n,
            max_response_length=cfg.data.max_response_length,
            seed=cfg.trainer.seed,
        )

    def compute_values(self, batch: Batch) -> Batch:
        return self.critic.compute_values(batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.update_critic(batch)

    def save_checkpoint(self, path: str) -> None:
        self.critic.save_checkpoint(f"{path}/critic")

    def load_checkpoint(self, path: str) -> None:
        self.critic.load_checkpoint(f"{path}/critic")
