r"""Reward for multiple-choice questions: the option's letter in \boxed{} (or <answer></answer>).

The chosen letter is read from the last \boxed{...}, else from the last <answer>...</answer>; the
text there must start with the letter, alone or as "(B)", "B." or "B) text". The ground truth is
the letter ("B", "(B)" and "B. text" work too). Letters are compared case-insensitively.

Returned keys, per sample:
  accuracy  1 if the chosen letter is the ground truth's, else 0.
  format    1 if a letter could be read from a \boxed{} or an <answer>, else 0.
  overall   (1 - format_weight) * accuracy + format_weight * format (format_weight = 0.1).

Self-contained. Format prompt: format_prompts/multiple_choice.jinja.
"""

import re

REWARD_NAME = "multiple_choice"
REWARD_TYPE = "batch"

_LETTER = re.compile(r"\s*\(?([A-Za-z])\)?(?=[\s.:)]|$)")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def read_letter(text: str) -> str | None:
    match = _LETTER.match(text)
    return match.group(1).upper() if match else None


def chosen_letter(response: str) -> str | None:
    for pattern in (_BOXED, _ANSWER):
        found = pattern.findall(response)
        if found:
            return read_letter(found[-1])
    return None


def compute_score(reward_inputs: list[dict], format_weight: float = 0.1) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        letter = chosen_letter(item["response"])
        truth = read_letter(str(item["ground_truth"]))
        accuracy = float(letter is not None and letter == truth)
        fmt = float(letter is not None)
        scores.append({
            "overall": (1 - format_weight) * accuracy + format_weight * fmt,
            "accuracy": accuracy,
            "format": fmt,
        })
    return scores
