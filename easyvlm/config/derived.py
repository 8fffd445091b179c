"""Values that follow from a validated config, computed once into a frozen `Derived`.

EasyR1 computes these by writing into the config inside workers (``global_batch_size *= n``);
here the config stays as the user wrote it and every role reads the same numbers from `Derived`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.schema import ActorConfig, CriticConfig, PPOConfig, RolloutConfig
from easyvlm.config.validate import validate


@dataclass(frozen=True)
class RoleBatching:
    """How one trained role (actor or critic) cuts a step's samples into optimizer steps."""

    mini_batch_samples: int
    """Samples per optimizer step: global_batch_size x rollout.n."""
    mini_batch_per_device: int
    """Samples of one mini-batch on one data-parallel rank."""
    grad_accum_steps: int
    """Micro-batches per device per optimizer step (without dynamic batching)."""
    mini_batches_per_step: int
    """Mini-batches per training step and PPO epoch: rollout_batch_size / global_batch_size."""
    optimizer_steps_per_step: int
    """Optimizer steps per training step: mini_batches_per_step x ppo_epochs."""


@dataclass(frozen=True)
class Derived:
    """Numbers every role needs, computed once by `derive` (never by writing into the config)."""

    world_size: int
    """Devices (GPUs, or worker processes on the CPU): trainer.nnodes x trainer.n_gpus_per_node."""
    data_parallel_size: int
    """world_size / worker.actor.ulysses_size."""
    rollout_engines: int
    """vLLM engines: world_size / worker.rollout.tensor_parallel_size."""
    samples_per_step: int
    """Sequences per training step: data.rollout_batch_size x worker.rollout.n (B)."""
    prompts_per_generation_round: int
    """data.mini_rollout_batch_size, or data.rollout_batch_size when unset."""
    max_sequence_length: int
    """data.max_prompt_length + data.max_response_length (P + T)."""
    rollout_max_model_len: int
    """worker.rollout.max_model_len, or max_sequence_length when unset."""
    use_critic: bool
    """A critic is built (algorithm.adv_estimator == gae)."""
    use_reference: bool
    """A reference model is built (the KL penalty is on: not algorithm.disable_kl)."""
    kl_in_reward: bool
    """The KL penalty is subtracted from the token rewards (on, and not algorithm.use_kl_loss)."""
    kl_in_loss: bool
    """The KL penalty is a term of the actor loss."""
    actor: RoleBatching
    """Batching of the actor update."""
    critic: Optional[RoleBatching]
    """Batching of the critic update; None without a critic."""
    tokenizer_path: str
    """worker.actor.model.tokenizer_path, or the model path when unset."""
    save_checkpoint_path: str
    """trainer.save_checkpoint_path, or checkpoints/<project_name>/<experiment_name> (as written:
    relative paths are not resolved here)."""
    val_rollout: RolloutConfig
    """worker.rollout with worker.rollout.val_override_config applied (sampling for validation)."""
    max_steps: Optional[int]
    """trainer.max_steps (None: total_steps depends on the data set size)."""
    total_epochs: int
    """trainer.total_epochs."""
    rollout_batch_size: int
    """data.rollout_batch_size (for total_steps)."""

    def steps_per_epoch(self, num_train_prompts: int) -> int:
        """Training steps in one pass over ``num_train_prompts`` prompts (the last partial batch is
        dropped). With online filtering a step may consume more prompts, so this is an upper bound."""
        steps = num_train_prompts // self.rollout_batch_size
        if steps == 0:
            raise ConfigError(
                [
                    Problem(
                        "data.rollout_batch_size",
                        f"({self.rollout_batch_size}) is larger than the training set ({num_train_prompts} prompts "
                        "after filtering), so not one step fits; lower it or add data",
                    )
                ]
            )
        return steps

    def total_steps(self, num_train_prompts: int) -> int:
        """Training steps of the run: trainer.max_steps if set, else epochs x steps per epoch."""
        if self.max_steps is not None:
            return self.max_steps
        return self.total_epochs * self.steps_per_epoch(num_train_prompts)


def derive(cfg: PPOConfig) -> Derived:
    """Validate ``cfg`` (raising `ConfigError`) and compute its `Derived` values."""
    validate(cfg)
    data, worker, trainer, algo = cfg.data, cfg.worker, cfg.trainer, cfg.algorithm
    world_size = trainer.nnodes * trainer.n_gpus_per_node
    longest = data.max_prompt_length + data.max_response_length
    use_critic = algo.adv_estimator == "gae"
    use_reference = not algo.disable_kl
    model = worker.actor.model
    assert model.model_path is not None  # validate() checked it
    return Derived(
        world_size=world_size,
        data_parallel_size=world_size // worker.actor.ulysses_size,
        rollout_engines=world_size // worker.rollout.tensor_parallel_size,
        samples_per_step=data.rollout_batch_size * worker.rollout.n,
        prompts_per_generation_round=data.mini_rollout_batch_size or data.rollout_batch_size,
        max_sequence_length=longest,
        rollout_max_model_len=worker.rollout.max_model_len or longest,
        use_critic=use_critic,
        use_reference=use_reference,
        kl_in_reward=use_reference and not algo.use_kl_loss,
        kl_in_loss=use_reference and algo.use_kl_loss,
        actor=_role_batching(cfg, worker.actor),
        critic=_role_batching(cfg, worker.critic) if use_critic else None,
        tokenizer_path=model.tokenizer_path or model.model_path,
        save_checkpoint_path=trainer.save_checkpoint_path
        or os.path.join("checkpoints", trainer.project_name, trainer.experiment_name),
        val_rollout=dataclasses.replace(worker.rollout, **worker.rollout.val_override_config, val_override_config={}),
        max_steps=trainer.max_steps,
        total_epochs=trainer.total_epochs,
        rollout_batch_size=data.rollout_batch_size,
    )


def _role_batching(cfg: PPOConfig, role: ActorConfig | CriticConfig) -> RoleBatching:
    world_size = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    dp = world_size // role.ulysses_size
    mini_samples = role.global_batch_size * cfg.worker.rollout.n
    per_device = mini_samples // dp
    mini_batches = cfg.data.rollout_batch_size // role.global_batch_size
    return RoleBatching(
        mini_batch_samples=mini_samples,
        mini_batch_per_device=per_device,
        grad_accum_steps=per_device // role.micro_batch_size_per_device_for_update,
        mini_batches_per_step=mini_batches,
        optimizer_steps_per_step=mini_batches * role.ppo_epochs,
    )
