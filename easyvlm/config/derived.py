"""Values that follow from a validated config, computed once into a frozen `Derived`.

EasyR1 computes these by writing into the config inside workers (``global_batch_size *= n``);
here the config stays as the user wrote it and every role reads the same numbers from `Derived`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from easyvlm.config.schema import PPOConfig
from easyvlm.workers.settings import ActorConfig, CriticConfig
from easyvlm.config.validate import validate


@dataclass(frozen=True)
class RoleBatching:
    """How one trained role (actor or critic) cuts a step's samples into optimizer steps."""

    mini_batch_per_device: int
    """Samples of one mini-batch (global_batch_size x rollout.n) on one data-parallel rank."""
    optimizer_steps_per_step: int
    """Optimizer steps per training step: (rollout_batch_size / global_batch_size) x ppo_epochs."""


@dataclass(frozen=True)
class Derived:
    """Numbers every role needs, computed once by `derive` (never by writing into the config)."""

    world_size: int
    """Devices (GPUs, or worker processes on the CPU): trainer.nnodes x trainer.n_gpus_per_node."""
    prompts_per_generation_round: int
    """data.mini_rollout_batch_size, or data.rollout_batch_size when unset."""
    rollout_max_model_len: int
    """worker.rollout.max_model_len, or data.max_prompt_length + data.max_response_length when unset."""
    rollout_max_num_seqs: int
    """worker.rollout.max_num_seqs, or when unset the most sequences one generation call gives an
    engine (`generation_sequences_per_engine`), at most MAX_NUM_SEQS_DEFAULT."""
    use_critic: bool
    """A critic is built (algorithm.adv_estimator == gae)."""
    use_reference: bool
    """A reference model is built (the KL penalty is on: not algorithm.disable_kl)."""
    kl_in_reward: bool
    """The KL penalty is subtracted from the token rewards (on, and not algorithm.use_kl_loss)."""
    kl_in_loss: bool
    """The KL penalty is a term of the actor loss (on, and algorithm.use_kl_loss; disable_kl wins)."""
    actor: RoleBatching
    """Batching of the actor update."""
    critic: Optional[RoleBatching]
    """Batching of the critic update; None without a critic."""
    save_checkpoint_path: str
    """trainer.save_checkpoint_path, or checkpoints/<project_name>/<experiment_name> (as written:
    relative paths are not resolved here)."""


def derive(cfg: PPOConfig) -> Derived:
    """Validate ``cfg`` (raising `ConfigError`) and compute its `Derived` values."""
    validate(cfg)
    data, worker, trainer, algo = cfg.data, cfg.worker, cfg.trainer, cfg.algorithm
    world_size = trainer.nnodes * trainer.n_gpus_per_node
    use_critic = algo.adv_estimator == "gae"
    use_reference = not algo.disable_kl
    return Derived(
        world_size=world_size,
        prompts_per_generation_round=data.mini_rollout_batch_size or data.rollout_batch_size,
        rollout_max_model_len=worker.rollout.max_model_len or data.max_prompt_length + data.max_response_length,
        rollout_max_num_seqs=worker.rollout.max_num_seqs
        or min(MAX_NUM_SEQS_DEFAULT, generation_sequences_per_engine(cfg, _engines(cfg, world_size))),
        use_critic=use_critic,
        use_reference=use_reference,
        kl_in_reward=use_reference and not algo.use_kl_loss,
        kl_in_loss=use_reference and algo.use_kl_loss,
        actor=_role_batching(cfg, worker.actor),
        critic=_role_batching(cfg, worker.critic) if use_critic else None,
        save_checkpoint_path=trainer.save_checkpoint_path
        or os.path.join("checkpoints", trainer.project_name, trainer.experiment_name),
    )


# vLLM's own default max_num_seqs: the most sequences an engine runs at once when the work is larger
MAX_NUM_SEQS_DEFAULT = 256


def _engines(cfg: PPOConfig, world_size: int) -> int:
    """Engines a generation call is split over: one per hybrid rank, or the separate rollout group's."""
    r = cfg.worker.rollout
    return r.num_devices if getattr(r, "placement", "colocated") == "separate" else world_size


def generation_sequences_per_engine(cfg: PPOConfig, engines: int) -> int:
    """The most sequences one generation call gives one of ``engines`` engines: the larger of a
    training round, ceil(prompts_per_round / engines) x worker.rollout.n, and (when validation runs)
    ceil(data.val_batch_size / engines) x the validation n, or MAX_NUM_SEQS_DEFAULT for the whole
    validation set in one call (val_batch_size -1: its size is unknown here)."""
    data, r, t = cfg.data, cfg.worker.rollout, cfg.trainer
    prompts = data.mini_rollout_batch_size or data.rollout_batch_size
    sequences = -(-prompts // engines) * r.n
    validates = bool(data.val_files) and (t.val_before_train or t.val_freq > 0 or t.val_only)
    if validates:
        val_n = int(r.val_override_config.get("n", r.n))
        val = MAX_NUM_SEQS_DEFAULT if data.val_batch_size <= 0 else -(-data.val_batch_size // engines) * val_n
        sequences = max(sequences, val)
    return sequences


def _role_batching(cfg: PPOConfig, role: ActorConfig | CriticConfig) -> RoleBatching:
    data_parallel = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // role.ulysses_size
    mini_batches = cfg.data.rollout_batch_size // role.global_batch_size
    return RoleBatching(
        mini_batch_per_device=role.global_batch_size * cfg.worker.rollout.n // data_parallel,
        optimizer_steps_per_step=mini_batches * role.ppo_epochs,
    )
