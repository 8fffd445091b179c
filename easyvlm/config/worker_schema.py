"""The typed ``worker`` section of the configuration: the actor, critic and reference model (their
model, optimizer, FSDP and offload settings), the rewards (functions, reward model, judge) and the
rollout. Same conventions as ``easyvlm.config.schema``, which holds the other sections. Composed
here from the components' declarations (``easyvlm.utils.compose``): the actor's, critic's,
reference model's, teacher's and reward model's sections (``easyvlm.workers.settings``, which
composes the actor's and critic's of the model, optimizer, FSDP and offload sections and the losses'
keys), the rollout's engine and sampling keys and its placement and asynchrony keys
(``easyvlm.rollout.settings``) and its multi-turn keys (``easyvlm.agents.settings``), the reward and
judge sections (``easyvlm.rewards.settings``); only ``worker`` itself is declared here."""

from __future__ import annotations

from dataclasses import dataclass, field

from easyvlm.agents.settings import AgentSettings
from easyvlm.rewards.settings import JudgeConfig, RewardConfig
from easyvlm.rollout.settings import GenerationSettings, PlacementSettings
from easyvlm.utils.compose import fields_of
from easyvlm.workers.settings import ActorConfig, CriticConfig, RefConfig, RewardModelConfig, TeacherConfig

@dataclass(frozen=True)
@fields_of(PlacementSettings, after="val_override_config", read_as="placement_settings")
@fields_of(AgentSettings, after="disable_tqdm", read_as="agent")
@fields_of(GenerationSettings, after=None, read_as="generation")
class RolloutConfig:
    """Made of splices alone, in this order: the engine and sampling keys, name ... disable_tqdm
    (GenerationSettings), the multi-turn keys, tools ... max_images_in_context (AgentSettings), then
    GenerationSettings' val_override_config, then the placement and asynchrony keys, placement ...
    weight_transfer (PlacementSettings)."""


@dataclass(frozen=True)
class WorkerConfig:
    hybrid_engine: bool = True
    """Actor, reference model and rollout engine share each device (EasyR1's only mode). false is
    refused: the rollout engines get devices of their own with worker.rollout.placement=separate."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (gae only)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy for the KL penalty."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """easyvlm extra. The teacher of on-policy distillation (`algorithm.distill_coef`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function(s)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """easyvlm extra. A trained reward model whose score the reward functions can use."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """easyvlm extra. A generative judge whose parsed verdict the reward functions can use."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
