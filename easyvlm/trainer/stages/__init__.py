"""The batch stages between sampling and the end of the update, in the plan's order: each built once
per run by its factory in ``STAGES`` from the `StageContext`, each reading and writing `StepState`."""

from __future__ import annotations

from typing import Callable

from easyvlm.trainer.stages.advantages import Advantages, distill_advantages, kl_in_reward, multi_objective, token_rewards
from easyvlm.trainer.stages.experience import (
    old_logprobs, ref_logprobs, remax_baseline, sampler_logprobs, teacher_logprobs, values,
)
from easyvlm.trainer.stages.rewards import rewards
from easyvlm.trainer.stages.state import Stage, StageContext, StepState
from easyvlm.trainer.stages.update import rollout_correction, update_actor, update_critic

# name -> factory(context) -> Stage; the plan's names (easyvlm.plan.stages) are these
STAGES: dict[str, Callable[[StageContext], Stage]] = {
    "remax_baseline": remax_baseline,
    "sampler_logprobs": sampler_logprobs,
    "old_logprobs": old_logprobs,
    "ref_logprobs": ref_logprobs,
    "teacher_logprobs": teacher_logprobs,
    "values": values,
    "rewards": rewards,
    "multi_objective": multi_objective,
    "token_rewards": token_rewards,
    "kl_in_reward": kl_in_reward,
    "advantages": Advantages,
    "distill_advantages": distill_advantages,
    "update_critic": update_critic,
    "rollout_correction": rollout_correction,
    "update_actor": update_actor,
}


def build_stages(names: tuple[str, ...], ctx: StageContext) -> list[tuple[str, Stage]]:
    """The plan's stages, each built on ``ctx``, in order."""
    unknown = [name for name in names if name not in STAGES]
    assert not unknown, f"stages the trainer does not know: {unknown}"
    return [(name, STAGES[name](ctx)) for name in names]


__all__ = ["STAGES", "Stage", "StageContext", "StepState", "build_stages"]
