"""From rewards to advantages (``easyvlm.algorithms``, timed as ``adv``): GDPO's score, token
rewards, the KL penalty in the reward, the estimator, and distillation's advantage."""

from __future__ import annotations


import torch

from easyvlm.agents.loop import TRAJECTORY_KEY
from easyvlm.algorithms import AdvantageInputs, apply_kl_penalty, get_advantage, kl_penalty
from easyvlm.algorithms.advantages import own_groups
from easyvlm.algorithms.distill import distill_advantages as teacher_advantages, distill_metrics
from easyvlm.algorithms.multi_objective import gdpo_scores, score_as_advantage
from easyvlm.algorithms.step_groups import step_group_metrics
from easyvlm.data.batch import Batch
from easyvlm.trainer import core
from easyvlm.utils.timing import timed
from easyvlm.trainer.stages.state import Stage, StageContext, StepState


def estimator_group_ids(batch: Batch) -> torch.Tensor:
    """The batch's group ids with each sample whose environment failed (``finish == "error"``: none of its
    tokens is trained, and its reward is not the policy's) in a group of its own, out of its group's
    statistics."""
    trajectories = batch.get(TRAJECTORY_KEY)
    if not trajectories:
        return batch["group_ids"]
    failed = torch.tensor([t["finish"] == "error" for t in trajectories], dtype=torch.bool)
    return own_groups(batch["group_ids"], failed)


def multi_objective(ctx: StageContext) -> Stage:
    """``normalize_then_sum``: GDPO's score of the functions' own scores is the sequence reward."""
    weights = ctx.advantage.reward_weights

    def run(state: StepState) -> None:
        with timed("adv", state.metrics):
            result = state.result
            per_function = torch.tensor([result.scores[k] for k in result.function_keys], dtype=torch.float32).T
            assert per_function.shape[1] == len(weights), "one score per reward function"
            state.sequence_rewards = gdpo_scores(per_function, weights, estimator_group_ids(state.batch))

    return run


def token_rewards(ctx: StageContext) -> Stage:
    """Each sequence's reward on its last response token."""

    def run(state: StepState) -> None:
        with timed("adv", state.metrics):
            state.token_rewards = core.place_seq_rewards(state.sequence_rewards, state.batch["response_mask"].bool())

    return run


def kl_in_reward(ctx: StageContext) -> Stage:
    """The KL to the reference, times the controller's coefficient, subtracted from the token rewards;
    the controller then adapts to the step's KL."""
    penalty = ctx.advantage.kl.kl_penalty

    def run(state: StepState) -> None:
        with timed("adv", state.metrics):
            batch = state.batch
            kl = batch["ref_kl"] if penalty == "full" else kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], penalty)
            state.token_rewards, kl_metrics = apply_kl_penalty(state.token_rewards, kl, ctx.kl_ctrl.value,
                                                               batch["response_mask"].bool())
            ctx.kl_ctrl.update(kl_metrics["kl"], n_steps=len(batch))
            state.metrics.update({"critic/kl": kl_metrics["kl"], "critic/kl_coef": kl_metrics["kl_coef"]})

    return run


class Advantages:
    """``algorithm.adv_estimator``'s advantages and returns (with GDPO under grpo, the score is the
    advantage as it is: TRL's). ``estimate``: the estimator the run uses."""

    def __init__(self, ctx: StageContext):
        self.spec = ctx.advantage
        self.estimate = get_advantage(self.spec.estimator)
        if self.spec.multi_objective_aggregation == "normalize_then_sum" and self.spec.estimator == "grpo":
            self.estimate = score_as_advantage

    def __call__(self, state: StepState) -> None:
        adv, batch = self.spec, state.batch
        with timed("adv", state.metrics):
            out = self.estimate(AdvantageInputs(
                token_rewards=state.token_rewards,
                response_mask=batch["response_mask"].bool(),
                group_ids=estimator_group_ids(batch),
                values=batch.get("values"),
                baseline_rewards=batch.get("baseline_rewards"),
                gamma=adv.gamma,
                lam=adv.lam,
                norm_by_std=adv.norm_by_std,
                # environment runs (easyvlm.agents.loop): what the step-level estimator (gigpo) reads
                turn_index=batch.get("turn_index"),
                step_rewards=batch.get("step_rewards"),
                step_anchors=batch.get("step_anchors"),
            ))
            batch["token_rewards"], batch["advantages"], batch["returns"] = state.token_rewards, out.advantages, out.returns
            if adv.estimator == "gigpo":
                state.metrics.update(step_group_metrics(batch["group_ids"], batch["step_anchors"], batch["turn_index"]))


def distill_advantages(ctx: StageContext) -> Stage:
    """On-policy distillation's advantages: distill_coef * (log pi_T - log pi_old) per token, added to the
    estimator's (``distill_as_reward``) or alone (``distill_only``; 0 with distillation as a loss term)."""
    settings = ctx.advantage.distill

    def run(state: StepState) -> None:
        with timed("adv", state.metrics):
            batch = state.batch
            mask = batch["response_mask"].bool()
            if settings.distill_as_reward:
                teacher, student = batch["teacher_logprobs"], batch["old_logprobs"]
                advantages = teacher_advantages(teacher, student, mask, settings.distill_coef)
                state.metrics.update({f"distill/{k}": v for k, v in distill_metrics(student - teacher, teacher, mask).items()})
            else:
                advantages = torch.zeros(mask.shape, dtype=torch.float32)
            if settings.distill_only:  # no estimator ran: the teacher's advantage is the whole of it
                batch["token_rewards"], batch["advantages"], batch["returns"] = state.token_rewards, advantages, advantages
            else:
                batch["advantages"] = batch["advantages"] + advantages

    return run
