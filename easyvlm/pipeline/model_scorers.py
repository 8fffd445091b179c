"""The scorers that are models: the reward model's worker group (``worker.reward_model``) and the
generative judge's engines (``worker.judge``), started from the run plan by the trainer and by
``python -m easyvlm.eval`` alike. Both run in Ray processes."""

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
    """The reward model's worker group (``spec``: the plan's `RewardModelSpec`) and the scores it
    gives a rollout batch, normalised as ``worker.reward_model.normalize`` says. ``pg`` and
    ``share``: colocate rank r with another group's rank r (the trainer's hybrid workers)."""
    group = WorkerGroup("reward_model", resources, partial(RewardModelHost, spec), pg=pg, share=share)
    scores = RewardModelScores(lambda batch: group.dispatch("compute_scores", model_inputs(batch)), spec.normalize)
    return group, scores


class ModelScorers:
    """The reward model's worker group and the judge's engines of a run that scores without training
    (``python -m easyvlm.eval``); Ray must be up when either is configured. ``scores`` / ``judge``:
    what the `Scorer` takes (None when not configured). ``trainer_state``: a checkpoint's
    ``trainer_state.pt``, whose running reward-model statistics normalise the scores as the
    trainer's validation did (``worker.reward_model.normalize=running``)."""

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
