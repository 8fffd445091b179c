"""Reward for easyvlm's built-in synthetic task: one-word answers ("red", "circle", "3").

Returned keys, per sample:
  accuracy  1 if the normalised response equals the normalised answer, else 0.
  format    1 if the response is one word or one number (surrounding spaces and one final . or !
            allowed), else 0.
  overall   (1 - format_weight) * accuracy + format_weight * format; format_weight = 0.1 by
            default, so a right answer scores 1.0 and a wrong single word 0.1.

Normalisation: lowercase, punctuation dropped, number words to digits ("Three" -> "3"), grey -> gray.
Self-contained: copy it and adapt it to a task of your own.
"""

import re

REWARD_NAME = "synthetic"
REWARD_TYPE = "batch"

_NUMBER_WORDS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_ONE_WORD = re.compile(r"\s*([A-Za-z]+|\d+)[.!]?\s*")


def normalize(text: str) -> str:
    words = re.sub(r"[^\w\s]", " ", str(text).lower()).split()
    words = ["gray" if w == "grey" else _NUMBER_WORDS.get(w, w) for w in words]
    return " ".join(words)


def compute_score(reward_inputs: list[dict], format_weight: float = 0.1) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        response = item["response"]
        accuracy = float(normalize(response) != "" and normalize(response) == normalize(item["ground_truth"]))
        fmt = float(_ONE_WORD.fullmatch(response) is not None)
        scores.append({
            "overall": (1 - format_weight) * accuracy + format_weight * fmt,
            "accuracy": accuracy,
            "format": fmt,
        })
    return scores
