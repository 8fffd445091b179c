"""The driver's slice of the run plan (`DriverSpec`): the settings the training loop itself reads,
its generation rounds, advantages and KL, and what the run writes. Plain frozen dataclasses: no
behaviour. ``easyvlm.plan.driver`` makes them; ``easyvlm.trainer`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from easyvlm.algorithms.rollout_correction_settings import RolloutCorrectionConfig
from easyvlm.algorithms.settings import DistillSettings, EntropySettings, KLSettings, OnlineFilterSettings


@dataclass(frozen=True)
class RoundsSpec:
    """How the driver gathers a step's samples (easyvlm.trainer.sampling)."""

    prompt_groups: int
    """Prompt groups a step trains on (``data.rollout_batch_size``)."""
    filtering: OnlineFilterSettings
    """DAPO's dynamic sampling: with ``online_filtering``, keep only groups whose mean ``filter_key``
    is in (filter_low, filter_high)."""
    max_rounds: int
    """``trainer.max_try_make_batch``: generation rounds a filtered step may take (-1 = no limit)."""
    seed: int
    """``worker.rollout.seed``, the root of the per-request sampling seeds (with ``per_request_seed``)."""
    per_request_seed: bool
    separate: bool
    """The engines run in their own worker group (``worker.rollout.placement=separate``)."""
    rollout_devices: int
    """Devices of that group (``worker.rollout.num_devices``)."""
    max_staleness: int
    """``worker.rollout.max_staleness`` (``one_step_off`` = 1): how many updates older than the
    weights it trains on a sample's weights may be; 0 = synchronous."""
    partial_rollout: bool
    """New weights reach the engines mid-generation; groups stream to the trainer as they complete."""
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
    """``algorithm.multi_objective_aggregation``: normalize_then_sum = GDPO's score from each reward
    function's own score (easyvlm.algorithms.multi_objective) replaces their weighted sum."""
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
    """Absolute: logs, the learning curve, rollout pages and checkpoints (``Derived.save_checkpoint_path``)."""
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
    entropy_control: Optional[EntropySettings] = None
    """Set when ``worker.actor.use_adaptive_entropy`` is on: the driver's controller
    (``easyvlm.algorithms.entropy.AdaptiveEntropyController``) sets the actor's entropy coefficient
    for each update (else the actor keeps ``entropy_coeff``)."""
    stages: tuple[str, ...] = ()
    """The batch stages between sampling and the end of the update, in order
    (``easyvlm.plan.stages.batch_stages``; run by ``easyvlm.trainer.stages``)."""
