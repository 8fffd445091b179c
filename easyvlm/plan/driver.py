"""The driver's slice of the run plan (`DriverSpec`): the settings the training loop itself reads."""

from __future__ import annotations

import dataclasses

from easyvlm.config.derived import Derived
from easyvlm.config.schema import PPOConfig
from easyvlm.specs import AdvantageSpec, DriverSpec, EntropyControlSpec, RecordsSpec, RoundsSpec


def driver_spec(cfg: PPOConfig, derived: Derived) -> DriverSpec:
    t, a, r = cfg.trainer, cfg.algorithm, cfg.worker.rollout
    rounds = RoundsSpec(
        prompt_groups=cfg.data.rollout_batch_size,
        online_filtering=a.online_filtering,
        filter_key=a.filter_key,
        filter_low=a.filter_low,
        filter_high=a.filter_high,
        max_rounds=t.max_try_make_batch,
        seed=r.seed,
        per_request_seed=r.per_request_seed,
        separate=r.placement == "separate",
        rollout_devices=r.num_devices,
        one_step_off=r.one_step_off,
        baseline=a.adv_estimator == "remax",
    )
    advantage = AdvantageSpec(
        estimator=a.adv_estimator,
        gamma=a.gamma,
        lam=a.lam,
        norm_by_std=a.norm_adv_by_std_in_grpo,
        kl_penalty=a.kl_penalty,
        kl_type=a.kl_type,
        kl_coef=a.kl_coef,
        kl_target=a.kl_target,
        kl_horizon=a.kl_horizon,
        kl_in_reward=derived.kl_in_reward,
        kl_in_loss=derived.kl_in_loss,
        use_reference=derived.use_reference,
        rollout_correction=a.rollout_correction,
        critic_warmup=t.critic_warmup,
        multi_objective_aggregation=a.multi_objective_aggregation,
        reward_weights=tuple(float(f.weight) for f in cfg.worker.reward.reward_functions),
    )
    records = RecordsSpec(
        run_dir=derived.save_checkpoint_path,
        loggers=tuple(t.logger),
        project_name=t.project_name,
        experiment_name=t.experiment_name,
        config_record=dataclasses.asdict(cfg),
        val_generations_to_log=t.val_generations_to_log,
        rollout_log_freq=t.rollout_log_freq,
        ray_timeline=t.ray_timeline,
        save_limit=t.save_limit,
        save_model_only=t.save_model_only,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        skip_special_tokens=cfg.worker.reward.skip_special_tokens,
    )
    return DriverSpec(
        val_before_train=t.val_before_train,
        val_only=t.val_only,
        val_freq=t.val_freq,
        save_freq=t.save_freq,
        nnodes=t.nnodes,
        reward_num_cpus=cfg.worker.reward.num_cpus,
        rounds=rounds,
        advantage=advantage,
        records=records,
        entropy_control=entropy_control(cfg),
    )


def entropy_control(cfg: PPOConfig) -> EntropyControlSpec | None:
    """The adaptive entropy controller's settings (``worker.actor.use_adaptive_entropy``), or None."""
    actor = cfg.worker.actor
    if not actor.use_adaptive_entropy:
        return None
    return EntropyControlSpec(
        init_coeff=actor.entropy_coeff,
        target=actor.entropy_target,
        delta=actor.entropy_coeff_delta,
        coeff_min=actor.entropy_coeff_min,
        coeff_max=actor.entropy_coeff_max,
    )
