"""Prompt batches -> the engine -> the scorer -> per-answer scores, generations, trajectories and captures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from easyvlm.agents.loop import TRAJECTORY_KEY, trajectory_metrics
from easyvlm.data.batch import Batch
from easyvlm.pipeline.scoring import Scorer
from easyvlm.rollout.base import VAL_CALL, seeded_prompts
from easyvlm.rollout.specs import Sampling
from easyvlm.viewer.records import RolloutCapture, capture_rollouts

Generate = Callable[[Batch, Sampling], Batch]


def validation_prompts(prompts: Batch, per_request_seed: bool, seed: int, step: int, index: int) -> Batch:
    """Validation batch ``index`` at ``step``, seeded as the trainer seeds it (if ``per_request_seed``)."""
    return seeded_prompts(prompts, seed, (VAL_CALL, step, index)) if per_request_seed else prompts


def val_metrics(scores: Mapping[str, list[float]]) -> dict[str, float]:
    """EasyR1's validation names: val/reward_score (overall) and val/<key>_reward for sub-scores."""
    out = {}
    for key, values in scores.items():
        mean = float(torch.tensor(values, dtype=torch.float64).mean())
        out["val/reward_score" if key == "overall" else f"val/{key}_reward"] = mean
    return out


@dataclass
class ScoredRollouts:
    """Every answer of a split, in order: its prompt's ``uids``, ``scores`` (reward key -> values), ``generations``
    (prompt, response, ground truth, overall); the multi-turn ``trajectories``; viewer captures when asked for."""

    uids: list[str] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)
    generations: list[tuple[str, str, Any, float]] = field(default_factory=list)
    trajectories: list[dict] = field(default_factory=list)
    captures: list[RolloutCapture] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        metrics = val_metrics(self.scores)
        metrics.update({f"val/{key}": value for key, value in trajectory_metrics(self.trajectories).items()})
        return metrics


def generate_and_score(batches: Iterable[Batch], generate: Generate, sampling: Sampling, scorer: Scorer, step: int,
                       split: str, seed: int | None, capture: bool) -> ScoredRollouts:
    """Sample ``sampling.n`` answers to each prompt and score them. ``seed``: ``worker.rollout.seed`` with
    ``per_request_seed``, else None; ``capture``: keep each batch for the rollout viewer under ``split``."""
    out = ScoredRollouts()
    for index, prompts in enumerate(batches):
        prompts = validation_prompts(prompts, seed is not None, seed or 0, step, index)
        batch = generate(prompts, sampling)
        out.trajectories += batch.get(TRAJECTORY_KEY) or []
        inputs = scorer.inputs(batch)
        result = scorer.compute(inputs)
        for key, values in result.scores.items():
            out.scores.setdefault(key, []).extend(values)
        out.uids += list(batch["uid"])
        out.generations += [(i.prompt, i.response, i.ground_truth, s) for i, s in zip(inputs, result.overall)]
        if capture:
            out.captures.append(capture_rollouts(step, split, batch, result.scores, result.overall))
    return out
