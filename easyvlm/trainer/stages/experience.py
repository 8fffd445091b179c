"""Stages that add the experience the update needs to the rollout batch, each one worker pass while
the reward actor scores."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from easyvlm.data.batch import Batch
from easyvlm.pipeline.model_scorers import model_inputs
from easyvlm.utils.timing import timed
from easyvlm.trainer.stages.state import Stage, StageContext, StepState


def remax_baseline(ctx: StageContext) -> Stage:
    """ReMax (arXiv:2310.10505): the reward of one greedy response per prompt, the baseline of each sample."""

    def run(state: StepState) -> None:
        with timed("gen_baseline", state.metrics):
            state.batch["baseline_rewards"] = greedy_baseline(ctx, state.prompts, state.batch)

    return run


def greedy_baseline(ctx: StageContext, prompts: Batch, batch: Batch) -> torch.Tensor:
    """The reward of the current policy's greedy response to each sample's prompt."""
    greedy = ctx.service.generate(prompts, dataclasses.replace(ctx.service.sampling, n=1, temperature=0.0))
    result = ctx.scorer.score(greedy)
    by_uid = dict(zip(greedy["uid"], result.overall))
    return torch.tensor([by_uid[uid] for uid in batch["uid"]], dtype=torch.float32)


def sampler_logprobs(ctx: StageContext) -> Stage:
    """The rollout correction's bypass mode: the sampler's log-probs are the old log-probs (no pass)."""

    def run(state: StepState) -> None:
        state.batch["old_logprobs"] = state.batch["rollout_logprobs"]

    return run


def worker_pass(group: Any, method: str, timing: str, replicas: int, **kwargs: Any) -> Stage:
    """A stage adding what ``group``'s ``method`` returns for the batch (timed as ``timing_s/<timing>``)."""

    def run(state: StepState) -> None:
        with timed(timing, state.metrics):
            state.batch = state.batch.union(group.dispatch(method, model_inputs(state.batch), replicas, **kwargs))

    return run


def old_logprobs(ctx: StageContext) -> Stage:
    """The actor's log-probs of the samples before the update (left out by the plan when the update
    is provably on-policy)."""
    return worker_pass(ctx.workers.hybrid, "compute_logprobs", "old", ctx.actor_sp)


def ref_logprobs(ctx: StageContext) -> Stage:
    """The reference model's log-probs (and ``ref_kl`` with ``kl_penalty=full`` in the reward)."""
    return worker_pass(ctx.workers.hybrid, "compute_ref_logprobs", "ref", ctx.actor_sp,
                       full_kl=ctx.advantage.kl.kl_penalty == "full")


def teacher_logprobs(ctx: StageContext) -> Stage:
    """On-policy distillation: the teacher's ``teacher_logprobs`` of the student's sampled tokens."""
    return worker_pass(ctx.workers.hybrid, "compute_teacher_logprobs", "teacher", ctx.actor_sp)


def values(ctx: StageContext) -> Stage:
    """The critic's values of every response token (GAE)."""
    return worker_pass(ctx.workers.critic, "compute_values", "values", ctx.critic_sp)
