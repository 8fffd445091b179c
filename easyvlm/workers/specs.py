"""The run plan's slices for the workers, made by ``easyvlm.plan.roles``: every value final and
checked, so a worker asserts what it relies on and never judges a user's value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from easyvlm.algorithms.settings import (
    DistillSettings, EntropySettings, KLSettings, PolicyLossSettings, ValueLossSettings,
)
from easyvlm.models.specs import ModelBundle, ModelSpec
from easyvlm.workers.settings import FSDPConfig, ForwardSettings, OffloadConfig, OptimConfig, UpdateSettings


@dataclass(frozen=True)
class MicroBatching:
    """How a rank cuts its samples into forward passes."""

    micro_batch_size: int
    """Samples per pass without dynamic batching, and the unit of the default token budget."""
    dynamic: bool
    max_token_len: Optional[int]
    """Dynamic batching's budget of attended tokens; None = micro_batch_size x the batch's padded length."""


@dataclass(frozen=True)
class ForwardSpec:
    """How a role runs its model over a batch (actor, reference and critic alike)."""

    settings: ForwardSettings
    """The role's forward keys (padding_free ... expert_parallel_size; the reference model's and the
    teacher's are the actor's). Dense models ignore expert_parallel_size; the micro-batches below
    carry dynamic_batching resolved."""
    temperature: float
    """Logits are divided by the rollout temperature before log-softmax (policy roles)."""
    blocked_token_ids: tuple[int, ...]
    use_torch_compile: bool
    experience: MicroBatching
    """Micro-batching of the no-grad passes (old / reference log-probs, values)."""
    vision_cache_mb: int = 0
    """MiB of frozen vision-tower outputs cached by image (``easyvlm.models.vision_cache``); 0 = off."""
    router_replay: str = "disabled"


@dataclass(frozen=True)
class UpdateSpec:
    """One training step of a trained role: epochs x mini-batches x micro-batches, then clip and step.
    The loss's aggregation (``loss_avg_mode``, which the mini-batch normaliser follows) is the role's
    loss's: the actor's policy loss, the critic's value loss."""

    settings: UpdateSettings
    """The role's update keys (max_grad_norm, ppo_epochs)."""
    mini_batch_per_rank: int
    """Samples of one optimizer step on one data-parallel rank (global_batch_size x n / data-parallel size)."""
    optimizer_steps_per_step: int
    micro: MicroBatching
    norm_length: int
    """The constant of loss_avg_mode seq-mean-token-sum-norm: data.max_response_length."""
    optim: OptimConfig
    total_steps: int = 0
    """Training steps of the run (the learning-rate schedule's length); set once the data is loaded."""


@dataclass(frozen=True)
class PolicyLossSpec:
    """The policy loss's settings, a plug-in's ``loss_type`` resolved to ``/abs/path/file.py:func``."""

    settings: PolicyLossSettings
    source: Optional[str] = field(default=None, repr=False)
    """A plug-in's file text, read in the driver: the worker runs it without a copy of the file."""


@dataclass(frozen=True)
class ActorSpec:
    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec
    update: UpdateSpec
    policy_loss: PolicyLossSpec
    kl_loss: Optional[KLSettings]
    """The KL to the reference as a loss term; None = not in the loss (``distill`` likewise)."""
    entropy: EntropySettings
    seed: int
    """Seeds torch before the model is built, so new weights (LoRA) are equal on every rank."""
    files: ModelBundle
    """Tokenizer, processor and generation config written with an HF export."""
    router_aux_loss_coef: float = 0.0
    """MoE policies: the router load-balancing loss's weight (resolved; 0 = off)."""
    distill: Optional[DistillSettings] = None
    distill_weight_cap: float = 2.0
    """Truncation of the one-sample distillation weight pi_theta / pi_old: ``rollout_is_threshold``'s upper bound."""
    policy_gradient: bool = True
    """False for pure distillation as a loss (``algorithm.distill_only``): the loss has no policy term."""


@dataclass(frozen=True)
class RefSpec:
    """A frozen model that gives log-probs of the policy's samples: the reference model or the teacher."""

    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec


@dataclass(frozen=True)
class CriticSpec:
    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec
    update: UpdateSpec
    value_loss: ValueLossSettings
    seed: int


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward model of ``worker.reward_model``: frozen, scoring each sequence at its last token."""

    model: ModelSpec
    """``hf_config`` is a scalar sequence-classification config (checked in the driver)."""
    fsdp: FSDPConfig
    forward: ForwardSpec
    normalize: str
    """``none`` or ``running`` (applied in the driver, which keeps the running statistics)."""
