"""What one training step's stages share: the batch and what the stages add to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor

from easyvlm.data.batch import UPDATE_INPUT_KEYS, Batch
from easyvlm.rewards.types import RewardResult


@dataclass
class StepState:
    """One step's data as it passes the stages (easyvlm.trainer.stages)."""

    step: int
    prompts: Batch
    batch: Batch
    """The rollout batch; stages add tensors to it."""
    reward: Any
    """The rewards in flight (Ray refs of the generation rounds' results, or a result)."""
    metrics: dict[str, float]
    result: Optional[RewardResult] = None
    scores: Optional[Tensor] = None
    """(B,) the overall reward of each sample, as logged (``critic/score``)."""
    sequence_rewards: Optional[Tensor] = None
    """(B,) what the advantages are computed from: ``scores``, or GDPO's score (multi_objective)."""
    token_rewards: Optional[Tensor] = None
    """(B, T) the sequence reward on each response's last token, minus the KL with kl_in_reward."""
    actor_batch: Optional[Batch] = None
    """The actor's update batch when it differs from the critic's (rollout correction)."""
    _update_batch: Optional[Batch] = field(default=None, repr=False)

    def update_batch(self) -> Batch:
        """What the updates read of the batch (``UPDATE_INPUT_KEYS``), selected once."""
        if self._update_batch is None:
            self._update_batch = self.batch.select(*[k for k in UPDATE_INPUT_KEYS if k in self.batch], meta=False)
        return self._update_batch


@dataclass(frozen=True)
class StageContext:
    """What the stages use of the run, made once by the Trainer; each factory reads only its part."""

    advantage: Any
    """The plan's ``AdvantageSpec``."""
    workers: Any = None
    service: Any = None
    """The ``RolloutService`` (ReMax's greedy baseline generates through it)."""
    scorer: Any = None
    """The ``Scorer`` of the reward actor (the rewards stage waits on it; ReMax scores with it)."""
    actor_sp: int = 1
    """Ranks per sample group of the actor's passes (Ulysses): the dispatch's ``replicas``."""
    critic_sp: int = 1
    kl_ctrl: Any = None
    """The KL coefficient's controller (kl_in_reward steps it; the Trainer checkpoints it)."""
    entropy_ctrl: Any = None
    """The adaptive entropy coefficient's controller, None when off (update_actor steps it)."""


Stage = Callable[[StepState], None]
"""A stage reads and writes the step's state (its timing and metrics go into ``state.metrics``)."""
