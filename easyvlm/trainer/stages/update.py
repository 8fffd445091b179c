"""The updates: the critic's, then (after the critic's warm-up) the rollout correction of the
actor's batch and the actor's update, with the adaptive entropy coefficient when it is on."""

from __future__ import annotations


from easyvlm.algorithms.rollout_correction import parse_rollout_correction
from easyvlm.algorithms.rollout_correction import rollout_correction as correction_weights
from easyvlm.utils.timing import timed
from easyvlm.trainer.stages.state import Stage, StageContext, StepState


def rank0_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Workers all-reduce their metrics, so every rank holds the global values: take rank 0's."""
    return dict(per_rank[0])


def update_critic(ctx: StageContext) -> Stage:
    def run(state: StepState) -> None:
        with timed("update_critic", state.metrics):
            per_rank = ctx.workers.critic.dispatch_collect("update_critic", state.update_batch(), ctx.critic_sp)
            state.metrics.update(rank0_metrics(per_rank))

    return run


def rollout_correction(ctx: StageContext) -> Stage:
    """The actor's update batch with importance weights, rejected tokens out of the mask and the loss's
    normaliser (verl). The critic keeps the full mask: its targets do not depend on the sampler."""
    rc = ctx.advantage.rollout_correction  # checked by the config check: parsing cannot fail
    config = parse_rollout_correction(rc)
    warmup = ctx.advantage.critic_warmup

    def run(state: StepState) -> None:
        if state.step <= warmup:  # no actor update yet
            return
        batch = state.update_batch()
        weights, keep, metrics = correction_weights(batch["old_logprobs"], batch["rollout_logprobs"],
                                                    batch["response_mask"].bool(), config)
        state.metrics.update({f"rollout_corr/{k}": v for k, v in metrics.items()})
        actor_batch = batch.copy()
        actor_batch["response_mask"] = keep
        if weights is not None:
            actor_batch["rollout_is_weights"] = weights
        state.actor_batch = actor_batch

    return run


def update_actor(ctx: StageContext) -> Stage:
    """The actor's update after ``critic_warmup`` steps."""
    warmup = ctx.advantage.critic_warmup

    def run(state: StepState) -> None:
        if state.step <= warmup:
            return
        ctrl = ctx.entropy_ctrl
        entropy = {} if ctrl is None else {"entropy_coeff": ctrl.bonus_coeff}  # adaptive: this update's coefficient
        batch = state.actor_batch if state.actor_batch is not None else state.update_batch()
        with timed("update_actor", state.metrics):
            per_rank = ctx.workers.hybrid.dispatch_collect("update_actor", batch, ctx.actor_sp, **entropy)
            state.metrics.update(rank0_metrics(per_rank))
        if ctrl is not None:  # the coefficient this update applied; the controller steps on its entropy
            state.metrics["actor/entropy_coeff"] = entropy["entropy_coeff"]
            ctrl.update(state.metrics["actor/entropy"])

    return run
