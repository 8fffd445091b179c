"""The batch stages the plan lists for a recipe (easyvlm.plan.stages), derived by hand from the
rules, and the trainer's registry of them (easyvlm.trainer.stages).

plan_for's base: reinforce_plus_plus, n = 1, 24 prompts a step, global_batch_size 4, so 6
optimizer steps a step (off-policy after the first: old log-probs are needed), KL on and in the
reward (EasyR1's defaults: disable_kl=false, use_kl_loss=false)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_testing import plan_for

REWARDS = Path(__file__).resolve().parents[2] / "reward_functions"
ONE_UPDATE = "worker.actor.global_batch_size=24"  # all 24 prompts in one mini-batch, one epoch: on-policy
ASYNC = ("worker.rollout.placement=separate", "worker.rollout.max_staleness=2")
TAIL = ("rewards", "token_rewards", "advantages", "update_actor")
# on-policy distillation with the student's own starting model as the teacher (same tokenizer)
TEACHER = ("algorithm.disable_kl=true", "algorithm.distill_coef=1.0", "worker.teacher.enable=true",
           "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl")
CASES = {
    # off-policy updates and the KL in the reward: old and reference log-probs, the KL stage
    "base": ((), ("old_logprobs", "ref_logprobs", "rewards", "token_rewards", "kl_in_reward", "advantages", "update_actor")),
    # on-policy and the KL as a loss term: the update's own pass gives the old log-probs; no KL in the reward
    "kl_loss": ((ONE_UPDATE, "algorithm.use_kl_loss=true"), ("ref_logprobs", *TAIL)),
    # the full KL as a loss term reads the reference inside the update: no reference pass either
    "full_kl_loss": ((ONE_UPDATE, "algorithm.use_kl_loss=true", "algorithm.kl_penalty=full"), TAIL),
    # on-policy with the KL in the reward: the KL reads the old log-probs, so they are computed
    "kl_in_reward_on_policy": ((ONE_UPDATE,), ("old_logprobs", "ref_logprobs", "rewards", "token_rewards", "kl_in_reward",
                                               "advantages", "update_actor")),
    "no_kl": ((ONE_UPDATE, "algorithm.disable_kl=true"), TAIL),
    # GAE: the critic's values before the rewards are waited for, its update before the actor's (the
    # actor's update is on-policy: no old log-probs)
    "gae": ((ONE_UPDATE, "algorithm.disable_kl=true", "algorithm.adv_estimator=gae"),
            ("values", "rewards", "token_rewards", "advantages", "update_critic", "update_actor")),
    "remax": ((ONE_UPDATE, "algorithm.disable_kl=true", "algorithm.adv_estimator=remax", "worker.rollout.n=2"),
              ("remax_baseline", *TAIL)),
    # the rollout correction compares the old log-probs with the sampler's: computed even on-policy
    "rollout_is": ((ONE_UPDATE, "algorithm.disable_kl=true", "algorithm.rollout_correction.rollout_is=token"),
                   ("old_logprobs", "rewards", "token_rewards", "advantages", "rollout_correction", "update_actor")),
    # asynchronous with nothing set: the staleness correction (token IS, decoupled PPO) with its pass
    "async_default": ((ONE_UPDATE, "algorithm.disable_kl=true", *ASYNC),
                      ("old_logprobs", "rewards", "token_rewards", "advantages", "rollout_correction", "update_actor")),
    # ... turned off: the stale samples are trained as if fresh (on-policy update: no pass)
    "async_uncorrected": ((ONE_UPDATE, "algorithm.disable_kl=true", *ASYNC, "worker.rollout.correct_staleness=false"),
                          TAIL),
    # ... and the user's own choice (bypass) is kept as set
    "async_bypass": ((ONE_UPDATE, "algorithm.disable_kl=true", *ASYNC, "algorithm.rollout_correction.bypass_mode=true"),
                     ("sampler_logprobs", *TAIL)),
    # bypass: the sampler's log-probs stand in for the old ones, no pass
    "bypass": (("algorithm.disable_kl=true", "algorithm.rollout_correction.bypass_mode=true"), ("sampler_logprobs", *TAIL)),
    "gdpo": ((ONE_UPDATE, "algorithm.disable_kl=true", "algorithm.adv_estimator=grpo", "worker.rollout.n=2",
              "algorithm.multi_objective_aggregation=normalize_then_sum", "worker.reward.reward_function=null",
              f"worker.reward.reward_functions=[{{reward_function: {REWARDS}/synthetic.py:compute_score, weight: 1}}, "
              f"{{reward_function: {REWARDS}/math.py:compute_score, weight: 0.5}}]"),
             ("rewards", "multi_objective", "token_rewards", "advantages", "update_actor")),
    # distillation as a loss term: the teacher's pass, read by the update (on-policy: no old log-probs)
    "distill_loss": ((ONE_UPDATE, *TEACHER), ("teacher_logprobs", *TAIL)),
    # the full reverse KL still runs the pass: distill/teacher_logprob is of the sampled tokens
    "distill_full_kl": ((ONE_UPDATE, *TEACHER, "algorithm.distill_full_kl=true"), ("teacher_logprobs", *TAIL)),
    # the teacher's advantage needs the student's log-probs before the update, even on-policy
    "distill_as_reward": ((ONE_UPDATE, *TEACHER, "algorithm.distill_as_reward=true"),
                          ("old_logprobs", "teacher_logprobs", "rewards", "token_rewards", "advantages",
                           "distill_advantages", "update_actor")),
    # pure distillation: the rewards are scored (metrics, validation), no estimator runs
    "distill_only": ((ONE_UPDATE, *TEACHER, "algorithm.distill_only=true"),
                     ("teacher_logprobs", "rewards", "token_rewards", "distill_advantages", "update_actor")),
    "distill_only_as_reward": ((ONE_UPDATE, *TEACHER, "algorithm.distill_only=true", "algorithm.distill_as_reward=true"),
                               ("old_logprobs", "teacher_logprobs", "rewards", "token_rewards", "distill_advantages",
                                "update_actor")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_lists_the_recipes_stages_in_order(tiny_model_path, case):
    overrides, expected = CASES[case]
    assert plan_for(tiny_model_path, *overrides).driver.stages == expected


def test_every_stage_the_plan_can_list_is_one_the_trainer_runs():
    from easyvlm.trainer.stages import STAGES

    assert {name for _, stages in CASES.values() for name in stages} == set(STAGES)


def test_experiment_config_records_the_stages(tiny_model_path, tmp_path):
    from easyvlm.trainer.loop import open_tracker

    plan = plan_for(tiny_model_path, f"trainer.save_checkpoint_path={tmp_path}")
    open_tracker(plan, total_steps=1, start_step=0).close()
    record = json.loads((tmp_path / "experiment_config.json").read_text())
    assert record["batch_stages"] == list(CASES["base"][1]) and record["algorithm"]["adv_estimator"] == "reinforce_plus_plus"


@pytest.mark.parametrize("overrides, expected", [
    ((), "token"),  # nothing set: the staleness correction, at the section's threshold
    (("algorithm.rollout_correction.rollout_is=sequence",), "sequence"),  # the user's choice kept
    (("algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.01"),
     None),  # rejection alone is a correction the user chose: no weights added
    (("worker.rollout.correct_staleness=false",), None),
])
def test_asynchronous_rollout_trains_with_the_staleness_correction_unless_told_otherwise(tiny_model_path, overrides,
                                                                                        expected):
    # the threshold acts with the weights only (the config check refuses it otherwise)
    threshold = ("algorithm.rollout_correction.rollout_is_threshold=3.0",) if expected else ()
    rc = plan_for(tiny_model_path, *ASYNC, *threshold, *overrides).driver.advantage.rollout_correction
    assert rc.rollout_is == expected and rc.rollout_is_threshold == ("3.0" if expected else "2.0")
    synchronous = plan_for(tiny_model_path, "worker.rollout.placement=separate").driver.advantage.rollout_correction
    assert synchronous.rollout_is is None  # synchronous samples are never stale
