"""The values that cross the reward boundary; docs/rewards.md is the contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The keys every input dict has. Extra dataset columns are added under their own names too, but
# never over one of these (they are always under "extra" as well).
STANDARD_KEYS = ("response", "response_length", "ground_truth", "prompt", "images", "original_image_sizes", "extra")
# The keys a multi-turn run (worker.rollout.tools / environment) adds; single-turn inputs do not have them.
MULTI_TURN_KEYS = ("messages", "tool_calls", "num_turns", "finish", "environment_reward", "environment_info")
# The keys a run with worker.reward_model or worker.judge adds.
MODEL_SCORE_KEYS = ("reward_model_score", "reward_model_raw_score", "judge_score")


@dataclass
class RewardInput:
    """One sample to score; each field is the key of the same name in docs/rewards.md, "What the
    function gets". ``trajectory``: multi-turn runs only, the values of ``MULTI_TURN_KEYS``."""

    response: str
    response_length: int
    ground_truth: Any
    prompt: str = ""
    images: list = field(default_factory=list)
    original_image_sizes: list[tuple[int, int]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    trajectory: dict[str, Any] | None = None
    reward_model_score: float | None = None
    """``worker.reward_model`` runs only: its score (standardised with ``normalize=running``) and the raw one."""
    reward_model_raw_score: float | None = None
    question: str = ""
    """The row's prompt column as written (``<image>`` placeholders, no format prompt or chat
    template): what a judge's template shows (not in the reward function's dict)."""
    judge_score: float | None = None
    """``worker.judge`` runs only: the parsed verdict (0 for a failure with ``on_error=zero``)."""

    def to_dict(self) -> dict[str, Any]:
        """The dict a reward function gets: the standard keys, each extra column by name, and the
        multi-turn and model-score keys of the runs that have them."""
        reserved = (*STANDARD_KEYS, *MULTI_TURN_KEYS, *MODEL_SCORE_KEYS)
        out = {k: v for k, v in self.extra.items() if k not in reserved}
        if self.trajectory is not None:
            out.update({k: self.trajectory[k] for k in MULTI_TURN_KEYS})
        if self.reward_model_score is not None:
            out.update(reward_model_score=self.reward_model_score, reward_model_raw_score=self.reward_model_raw_score)
        if self.judge_score is not None:
            out["judge_score"] = self.judge_score
        out.update(
            response=self.response,
            response_length=self.response_length,
            ground_truth=self.ground_truth,
            prompt=self.prompt,
            images=list(self.images),
            original_image_sizes=None if self.original_image_sizes is None else list(self.original_image_sizes),
            extra=dict(self.extra),
        )
        return out


@dataclass
class RewardResult:
    """Scores of B samples. scores: "overall" plus every sub-score ("<REWARD_NAME>/<key>" with several
    functions), each B floats. metrics: "reward/<key>" means and "reward/error_count"; errors: their
    messages. function_keys: each function's own ``overall`` key, in config order (GDPO); [] with one."""

    scores: dict[str, list[float]]
    metrics: dict[str, float]
    errors: list[str] = field(default_factory=list)
    function_keys: list[str] = field(default_factory=list)

    @property
    def overall(self) -> list[float]:
        """(B,) the reward each sample trains on."""
        return self.scores["overall"]


class RewardError(RuntimeError):
    """A reward function that cannot be loaded or failed; the message names file, function, sample, problem."""

    def __init__(self, message: str, spec: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.spec = spec
        self.sample_index = sample_index

    def __reduce__(self):  # keep the fields when Ray pickles the error back to the driver
        return (type(self), (str(self), self.spec, self.sample_index))
