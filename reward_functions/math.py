r"""Reward for math problems: the final answer in \boxed{}, after a <think> block; checked by math-verify.

Returned keys, per sample:
  accuracy  1 if the last \boxed{...} of the response equals the ground truth mathematically
            (math-verify: "0.5" = "\frac{1}{2}", "x=2" = "2"), else 0; no \boxed{} scores 0.
  format    1 if the response is "<think>...</think>" followed by text with a \boxed{...}, else 0.
  overall   (1 - format_weight) * accuracy + format_weight * format (format_weight = 0.1).

A check longer than ``timeout`` seconds counts as wrong. easyvlm's math_equal makes math-verify's
timeout work in any thread (math-verify's own only works in the main thread). Format prompt:
format_prompts/math.jinja.
"""

import re

from easyvlm.rewards.mathcheck import extract_boxed, math_equal

REWARD_NAME = "math"
REWARD_TYPE = "batch"

_THINK_THEN_REST = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def format_score(response: str) -> float:
    match = _THINK_THEN_REST.fullmatch(response)
    if match is None or "<think>" in match.group(1) or "think>" in match.group(2):
        return 0.0
    return float(extract_boxed(match.group(2)) is not None)


def accuracy_score(response: str, ground_truth: str, timeout: float) -> float:
    answer = extract_boxed(response)
    return float(answer is not None and math_equal(answer, str(ground_truth), timeout=timeout))


def compute_score(
    reward_inputs: list[dict], format_weight: float = 0.1, timeout: float = 5.0
) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        fmt = format_score(item["response"])
        accuracy = accuracy_score(item["response"], item["ground_truth"], timeout)
        scores.append({
            "overall": (1 - format_weight) * accuracy + format_weight * fmt,
            "format": fmt,
            "accuracy": accuracy,
        })
    return scores
