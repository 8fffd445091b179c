"""The generative judge's score as the reward (needs worker.judge.enable=true), and a verdict parser.

``parse_yes_no`` (worker.judge.parser=reward_functions/judge.py:parse_yes_no) reads a verdict that
starts with yes or no (case, spaces and punctuation ignored): 1.0 for yes, 0.0 for no; anything else
raises, which the judge counts as a parse failure (judge/parse_failures; with
worker.judge.on_error=zero the sample scores 0).

``compute_score`` returns the parsed verdict each input carries as ``judge_score``.

Returned keys, per sample:
  overall  the judge's score.
  judge    the same (logged as reward/judge).
"""

from __future__ import annotations

import re

REWARD_NAME = "judge"
REWARD_TYPE = "batch"

_FIRST_WORD = re.compile(r"\W*([A-Za-z]+)")


def parse_yes_no(verdict: str, sample: dict) -> float:
    match = _FIRST_WORD.match(verdict)
    word = match.group(1).lower() if match else ""
    if word in ("yes", "no"):
        return 1.0 if word == "yes" else 0.0
    raise ValueError(f"the verdict does not start with yes or no: {verdict[:80]!r}")


def compute_score(reward_inputs: list[dict]) -> list[dict[str, float]]:
    missing = [i for i, item in enumerate(reward_inputs) if item.get("judge_score") is None]
    if missing:
        raise ValueError(f"sample {missing[0]} has no judge_score: set worker.judge.enable=true with worker.judge.model_path, "
                         "template and parser")
    return [{"overall": float(item["judge_score"]), "judge": float(item["judge_score"])} for item in reward_inputs]
