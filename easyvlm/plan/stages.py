"""The batch stages of a run, in order: what the driver does to a step's rollout batch between
sampling and the end of the update (``easyvlm.trainer.stages`` runs them). Chosen here, from the
plan's slices, so that a recipe's stages can be read before it runs (``experiment_config.json``
records them as ``batch_stages``; docs/architecture.md lists every stage)."""

from __future__ import annotations

from typing import Optional

from easyvlm.algorithms.rollout_correction import parse_rollout_correction
from easyvlm.plan.specs import DriverSpec
from easyvlm.workers.specs import ActorSpec, CriticSpec
from easyvlm.workers.actor import update_is_on_policy


def batch_stages(driver: DriverSpec, actor: ActorSpec, critic: Optional[CriticSpec]) -> tuple[str, ...]:
    adv = driver.advantage
    rc = adv.rollout_correction
    correction = parse_rollout_correction(rc)
    full_kl = adv.kl.kl_penalty == "full"
    distill = adv.distill.distill_coef > 0
    # the teacher's advantage needs the student's log-probs before the update
    distill_advantage = distill and adv.distill.distill_as_reward
    pure = distill and adv.distill.distill_only  # no advantage from the reward
    stages: list[str] = []
    if driver.rounds.baseline:  # ReMax
        stages.append("remax_baseline")
    if rc.bypass_mode:
        stages.append("sampler_logprobs")
    elif correction.active or distill_advantage or not update_is_on_policy(actor.update.optimizer_steps_per_step,
                                                                            adv.kl_in_reward):
        stages.append("old_logprobs")  # else the update's own forward pass, detached, gives them
    if adv.use_reference and not (full_kl and adv.kl_in_loss):  # the full KL loss reads the reference in the update
        stages.append("ref_logprobs")
    if distill:
        stages.append("teacher_logprobs")
    if critic is not None:
        stages.append("values")
    stages.append("rewards")
    if adv.multi_objective_aggregation == "normalize_then_sum" and not pure:
        stages.append("multi_objective")
    stages.append("token_rewards")
    if adv.kl_in_reward:
        stages.append("kl_in_reward")
    if not pure:
        stages.append("advantages")
    if distill_advantage or pure:
        stages.append("distill_advantages")
    if critic is not None:
        stages.append("update_critic")
    if correction.active:
        stages.append("rollout_correction")
    stages.append("update_actor")
    return tuple(stages)
