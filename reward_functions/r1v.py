"""Reward in the R1-V style: "<think>...</think><answer>...</answer>", the answer compared with the truth.

Returned keys, per sample:
  accuracy  1 if the text inside the last <answer></answer> equals the ground truth, else 0:
            equal as strings after lowercasing and trimming spaces and a final period, or, when the
            ground truth has a digit or a LaTeX command, equal as mathematics (math-verify).
            Words are never compared by math-verify: it would read "cat" and "act" as c*a*t.
  format    1 if the response is exactly one <think> block then one <answer> block, else 0.
  overall   (1 - format_weight) * accuracy + format_weight * format (format_weight = 0.5).

Format prompt: format_prompts/r1v.jinja.
"""

import re

from easyvlm.rewards.mathcheck import math_equal

REWARD_NAME = "r1v"
REWARD_TYPE = "batch"

_NO_TAG = r"(?:(?!</?think>|</?answer>).)*"  # any text without a think or answer tag
_FORMAT = re.compile(rf"\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _normalize(text: str) -> str:
    return " ".join(str(text).strip().rstrip(".").lower().split())


def accuracy_score(response: str, ground_truth: str, timeout: float) -> float:
    answers = _ANSWER.findall(response)
    if not answers or not answers[-1].strip():
        return 0.0
    answer, truth = answers[-1].strip(), str(ground_truth).strip()
    if _normalize(answer) == _normalize(truth):
        return 1.0
    if re.search(r"[\d\\]", truth):
        return float(math_equal(answer, truth, timeout=timeout))
    return 0.0


def compute_score(
    reward_inputs: list[dict], format_weight: float = 0.5, timeout: float = 5.0
) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        fmt = float(_FORMAT.fullmatch(item["response"]) is not None)
        accuracy = accuracy_score(item["response"], item["ground_truth"], timeout)
        scores.append({
            "overall": (1 - format_weight) * accuracy + format_weight * fmt,
            "format": fmt,
            "accuracy": accuracy,
        })
    return scores
