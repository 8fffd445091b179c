"""The driver's slice of the run plan (`DriverSpec`), frozen dataclasses made by
``easyvlm.plan.driver`` and read by ``easyvlm.trainer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from easyvlm.algorithms.rollout_correction_settings import RolloutCorrectionConfig
from easyvlm.algorithms.settings import DistillSettings, EntropySettings, KLSettings, OnlineFilterSettings
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.rollout.settings import PlacementSettings


@dataclass(frozen=True)
class RoundsSpec:
    """How the driver gathers a step's samples (easyvlm.service.rounds)."""

    prompt_groups: int
    """Prompt groups a step trains on (``data.rollout_batch_size``)."""
    filtering: OnlineFilterSettings
    """DAPO's dynamic sampling (``algorithm.online_filtering`` ...)."""
    max_rounds: int
    """``trainer.max_try_make_batch``: generation rounds a filtered step may take (-1 = no limit)."""
    seed: int
    """``worker.rollout.seed``, the root of the per-request sampling seeds (with ``per_request_seed``)."""
    per_request_seed: bool
    placement: PlacementSettings
    """Where the engines run and how far ahead they generate (``worker.rollout.placement`` ...)."""
    prompts_per_round: int
    """Prompts one generation round takes: ``data.mini_rollout_batch_size`` or ``rollout_batch_size``
    (the training loader's batch)."""
    baseline: bool
    """ReMax: one greedy response per prompt gives the baseline reward."""


@dataclass(frozen=True)
class AdvantageSpec:
    """From rewards to advantages, and which passes the step runs before (easyvlm.trainer.loop)."""

    estimator: str
    """``algorithm.adv_estimator`` (a plug-in's path resolved)."""
    gamma: float
    lam: float
    norm_by_std: bool
    """``algorithm.norm_adv_by_std_in_grpo``."""
    kl: KLSettings
    """The KL penalty's settings: its estimator, and the controller of its coefficient in the reward."""
    kl_in_reward: bool
    """The KL to the reference is subtracted from the token rewards (``Derived.kl_in_reward``)."""
    kl_in_loss: bool
    use_reference: bool
    rollout_correction: RolloutCorrectionConfig
    """``algorithm.rollout_correction`` (checked: it parses), or with asynchronous rollout and nothing
    set there the staleness correction (``rollout_correction_settings.staleness_correction``)."""
    critic_warmup: int
    """Steps that train the critic alone."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """``algorithm.multi_objective_aggregation`` (normalize_then_sum: GDPO)."""
    reward_weights: tuple[float, ...] = ()
    """The weight of each of ``worker.reward.reward_functions``, in their order (empty for one
    ``reward_function``): GDPO's w_k."""
    distill: DistillSettings = DistillSettings()
    """On-policy distillation (``algorithm.distill_*``): the teacher pass, and with
    ``distill_as_reward`` or ``distill_only`` the advantages it gives."""


@dataclass(frozen=True)
class RecordsSpec:
    """What the run writes: metrics, validation generations, rollout pages, checkpoints."""

    run_dir: str
    """Absolute: logs, the learning curve, rollout pages and checkpoints (``trainer.save_checkpoint_path`` or ``checkpoints/<project>/<experiment>``)."""
    loggers: tuple[str, ...]
    project_name: str
    experiment_name: str
    config_record: dict
    """The whole config as plain values: experiment_config.json and the trackers' run parameters."""
    val_generations_to_log: int
    rollout_log_freq: int
    ray_timeline: Optional[str]
    save_limit: int
    save_model_only: bool
    max_prompt_length: int
    max_response_length: int
    """Of ``data``: the length metrics' clip ratios."""
    skip_special_tokens: bool
    """``worker.reward.skip_special_tokens``: how responses are decoded for rewards and pages."""


@dataclass(frozen=True)
class RunLength:
    """How many steps a run trains: ``trainer.max_steps``, or its epochs over the training prompts."""

    max_steps: Optional[int]
    total_epochs: int
    rollout_batch_size: int

    def steps_per_epoch(self, num_train_prompts: int) -> int:
        """Steps in one pass over the prompts (the last partial batch dropped); with online filtering
        a step may take more prompts, so an upper bound. ConfigError when not one step fits."""
        steps = num_train_prompts // self.rollout_batch_size
        if steps == 0:
            raise ConfigError([Problem("data.rollout_batch_size", (
                f"({self.rollout_batch_size}) is larger than the training set ({num_train_prompts} prompts "
                "after filtering), so not one step fits; lower it or add data"))])
        return steps

    def total_steps(self, num_train_prompts: int) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return self.total_epochs * self.steps_per_epoch(num_train_prompts)


@dataclass(frozen=True)
class LaunchSpec:
    """What a run asks of its cluster (easyvlm.plan.launch: Ray's start and each rank's share)."""

    ray_address: Optional[str]
    world_size: int
    """Training ranks: ``trainer.nnodes`` x ``trainer.n_gpus_per_node``."""
    n_gpus_per_node: int
    judge_engines: int
    """Judge engines, each its own process (0 without ``worker.judge``)."""
    separate_rollout_devices: int
    """The separate rollout group's devices (0 when the engines share the actor's ranks)."""


@dataclass(frozen=True)
class DriverSpec:
    """The driver's own settings (easyvlm.trainer): its loop, rounds, advantages and records."""

    val_before_train: bool
    val_only: bool
    val_freq: int
    save_freq: int
    nnodes: int
    reward_num_cpus: int
    """CPUs of the reward actor (``worker.reward.num_cpus``)."""
    rounds: RoundsSpec
    advantage: AdvantageSpec
    records: RecordsSpec
    length: RunLength
    load_checkpoint_path: Optional[str]
    find_last_checkpoint: bool
    entropy_control: Optional[EntropySettings] = None
    """Set when ``worker.actor.use_adaptive_entropy`` is on: the driver then sets the actor's
    entropy coefficient for each update."""
    stages: tuple[str, ...] = ()
    """The batch stages, in order (``easyvlm.plan.stages.batch_stages``)."""
