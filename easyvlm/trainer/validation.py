"""Validation: the validation prompts sampled with the validation sampling, scored, and turned into
``val/`` metrics, rollout pages and logged generations."""

from __future__ import annotations

import ray

from easyvlm.agents.loop import TRAJECTORY_KEY, trajectory_metrics
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.rewards.types import RewardResult
from easyvlm.specs import Sampling
from easyvlm.trainer import core
from easyvlm.trainer.metrics import val_metrics
from easyvlm.trainer.sampling import StepSampler
from easyvlm.trainer.tracking import Generation, Tracker
from easyvlm.viewer.records import RolloutCapture, capture_rollouts
from easyvlm.viewer.writer import RolloutWriter


def validate(step: int, loader: PromptDataLoader | None, sampler: StepSampler, sampling: Sampling,
             generations_to_log: int, viewer: RolloutWriter | None, tracker: Tracker | None) -> dict[str, float]:
    """The ``val/`` metrics of the policy at ``step`` (nothing without validation data)."""
    if loader is None:
        return {}
    scorer, spec = sampler.scorer, sampler.spec
    scores: dict[str, list[float]] = {}
    samples = []
    trajectories: list[dict] = []
    captures: list[RolloutCapture] = []
    sampler.sync()  # the current weights (queued after a one_step_off generation in flight)
    for index, prompts in enumerate(loader):
        prompts = core.validation_prompts(prompts, spec.per_request_seed, spec.seed, step, index)
        batch = sampler.workers.rollout.generate(prompts, sampling)
        trajectories += batch.get(TRAJECTORY_KEY) or []
        inputs = scorer.inputs(batch)
        result: RewardResult = ray.get(scorer.submit(inputs))
        for key, values in result.scores.items():
            scores.setdefault(key, []).extend(values)
        samples.extend(zip([i.prompt for i in inputs], [i.response for i in inputs], [i.ground_truth for i in inputs], result.overall))
        if viewer is not None:
            captures.append(capture_rollouts(step, "val", batch, result.scores, result.overall))
    if viewer is not None:
        viewer.submit(captures)
    metrics = val_metrics(scores)
    metrics.update({f"val/{key}": value for key, value in trajectory_metrics(trajectories).items()})
    if generations_to_log > 0 and tracker is not None:
        tracker.log_generations(step, [Generation(p, r, str(g), s) for p, r, g, s in samples[:generations_to_log]])
    return metrics
