"""The driver's slice of the run plan (`DriverSpec`). Each part takes the fields it shares by name
with the config's sections (``settings_of``); what is written out here is derived or renamed.
"""

from __future__ import annotations

import dataclasses

from easyvlm.algorithms.rollout_correction_settings import staleness_correction
from easyvlm.config.derived import Derived
from easyvlm.config.schema import PPOConfig
from easyvlm.plan.specs import AdvantageSpec, DriverSpec, RecordsSpec, RoundsSpec, RunLength
from easyvlm.utils.compose import settings_of


def driver_spec(cfg: PPOConfig, derived: Derived) -> DriverSpec:
    t, a, r = cfg.trainer, cfg.algorithm, cfg.worker.rollout
    placement = r.placement_settings
    # seed, per_request_seed: the rollout's keys
    rounds = settings_of(
        RoundsSpec, r,
        prompt_groups=cfg.data.rollout_batch_size,
        filtering=a.online_filter,
        max_rounds=t.max_try_make_batch,
        baseline=a.adv_estimator == "remax",
        placement=placement,
        prompts_per_round=derived.prompts_per_generation_round,
    )
    # gamma, lam, kl, rollout_correction, multi_objective_aggregation: the algorithm's; kl_in_reward,
    # kl_in_loss, use_reference: derived; critic_warmup: the trainer's
    advantage = settings_of(
        AdvantageSpec, a, derived, t,
        estimator=a.adv_estimator,
        norm_by_std=a.norm_adv_by_std_in_grpo,
        reward_weights=tuple(float(f.weight) for f in cfg.worker.reward.reward_functions),
        rollout_correction=staleness_correction(a.rollout_correction, placement.staleness, placement.correct_staleness),
    )
    # the trainer's keys (project_name, save_limit, ...), the data's lengths, the reward's decoding
    records = settings_of(
        RecordsSpec, t, cfg.data, cfg.worker.reward,
        run_dir=derived.save_checkpoint_path,
        loggers=tuple(t.logger),
        config_record=dataclasses.asdict(cfg),
    )
    actor = cfg.worker.actor
    return settings_of(
        DriverSpec, t,  # val_before_train, val_only, val_freq, save_freq, nnodes, load_checkpoint_path, ...
        reward_num_cpus=cfg.worker.reward.num_cpus,
        length=settings_of(RunLength, t, rollout_batch_size=cfg.data.rollout_batch_size),
        rounds=rounds,
        advantage=advantage,
        records=records,
        entropy_control=actor.entropy if actor.use_adaptive_entropy else None,
    )
