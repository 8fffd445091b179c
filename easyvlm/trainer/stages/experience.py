"""Stages that add the experience the update needs to the rollout batch: the ReMax baseline, the
old log-probs (or the sampler's in their place), the reference's and the teacher's log-probs and the
critic's values.
Each is one worker pass (the reward actor scores meanwhile)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from easyvlm.data.batch import Batch
from easyvlm.pipeline.model_scorers import model_inputs
from easyvlm.trainer.metrics import timed
from easyvlm.trainer.stages.state import Stage, StepState


def remax_baseline(trainer: Any) -> Stage:
    """ReMax (arXiv:2310.10505): the reward of one greedy response per prompt, the baseline of each sample."""

    def run(state: StepState) -> None:
        with timed("gen_baseline", state.metrics):
            state.batch["baseline_rewards"] = greedy_baseline(trainer, state.prompts, state.batch)

    return run


def greedy_baseline(trainer: Any, prompts: Batch, batch: Batch) -> torch.Tensor:
    """The reward of the current policy's greedy response to each sample's prompt."""
    greedy = trainer.service.generate(prompts, dataclasses.replace(trainer.service.sampling, n=1, temperature=0.0))
    result = trainer.scorer.score(greedy)
    by_uid = dict(zip(greedy["uid"], result.overall))
    return torch.tensor([by_uid[uid] for uid in batch["uid"]], dtype=torch.float32)


def sampler_logprobs(trainer: Any) -> Stage:
    """The rollout correction's bypass mode: the sampler's log-probs are the old log-probs (no pass)."""

    def run(state: StepState) -> None:
        state.batch["old_logprobs"] = state.batch["rollout_logprobs"]

    return run


def old_logprobs(trainer: Any) -> Stage:
    """The actor's log-probs of the samples before the update (the plan leaves this pass out when the
    update is provably on-policy: its own forward pass, detached, gives them)."""

    def run(state: StepState) -> None:
        with timed("old", state.metrics):
            out = trainer.workers.hybrid.dispatch("compute_logprobs", model_inputs(state.batch), trainer.actor_sp)
            state.batch = state.batch.union(out)

    return run


def ref_logprobs(trainer: Any) -> Stage:
    """The reference model's log-probs (``ref_kl``: the full KL, with ``algorithm.kl_penalty=full``
    in the reward; as a loss term the update computes it itself)."""
    full_kl = trainer.spec.advantage.kl.kl_penalty == "full"

    def run(state: StepState) -> None:
        with timed("ref", state.metrics):
            out = trainer.workers.hybrid.dispatch("compute_ref_logprobs", model_inputs(state.batch), trainer.actor_sp,
                                                  full_kl=full_kl)
            state.batch = state.batch.union(out)

    return run


def teacher_logprobs(trainer: Any) -> Stage:
    """On-policy distillation: the teacher's log-probs of the student's sampled tokens
    (``teacher_logprobs``), in the same packed rows as the reference pass (``timing_s/teacher``)."""

    def run(state: StepState) -> None:
        with timed("teacher", state.metrics):
            out = trainer.workers.hybrid.dispatch("compute_teacher_logprobs", model_inputs(state.batch), trainer.actor_sp)
            state.batch = state.batch.union(out)

    return run


def values(trainer: Any) -> Stage:
    """The critic's values of every response token (GAE)."""

    def run(state: StepState) -> None:
        with timed("values", state.metrics):
            out = trainer.workers.critic.dispatch("compute_values", model_inputs(state.batch), trainer.critic_sp)
            state.batch = state.batch.union(out)

    return run
