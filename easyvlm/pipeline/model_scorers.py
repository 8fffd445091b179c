"""The scorers that are models (``worker.reward_model``'s worker group, ``worker.judge``'s engines), in Ray."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from easyvlm.data.batch import MODEL_INPUT_KEYS, Batch
from easyvlm.distributed.worker_group import Resources, WorkerGroup
from easyvlm.rewards.judge import Judge
from easyvlm.rewards.model_scores import RewardModelScores
from easyvlm.utils.safe_state import load_state
from easyvlm.workers.hosts import RewardModelHost


def model_inputs(batch: Batch) -> Batch:
    """What the workers' forward passes read (tensors and vision inputs), without the rest."""
    return batch.select(*[k for k in MODEL_INPUT_KEYS if k in batch], meta=False)


def start_reward_model(spec: Any, resources: Resources | None, pg: Any = None,
                       share: float = 1.0) -> tuple[WorkerGroup, RewardModelScores]:
    """The reward model's worker group and its normalised scores of a rollout batch; ``pg`` and ``share``:
    colocate rank r with another group's rank r (the trainer's hybrid workers)."""
    group = WorkerGroup("reward_model", resources, partial(RewardModelHost, spec), pg=pg, share=share)
    scores = RewardModelScores(lambda batch: group.dispatch("compute_scores", model_inputs(batch)), spec.normalize)
    return group, scores


class ModelScorers:
    """A scoring-only run's (``python -m easyvlm.eval``; needs Ray) reward-model group and judge engines: ``scores`` /
    ``judge`` for the `Scorer` (None if unconfigured); ``trainer_state``: normalise as that checkpoint's validation did."""

    def __init__(self, reward_model: Any, judge: Any, resources: Resources | None, trainer_state: Path | None = None):
        self.group: WorkerGroup | None = None
        self.scores: RewardModelScores | None = None
        self.judge: Judge | None = None
        try:
            if judge is not None:
                self.judge = Judge(judge)
            if reward_model is not None:
                self.group, self.scores = start_reward_model(reward_model, resources)
                if trainer_state is not None and trainer_state.is_file():
                    moments = load_state(trainer_state).get("reward_model_scores")
                    if moments is not None:
                        self.scores.load_state_dict(moments)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if self.judge is not None:
            self.judge.close()
