"""DAPO's reward (arXiv:2503.14476, section 3.4 and eq. 13): +1 for a right answer, -1 for a wrong
one, plus a soft penalty for responses that run into the length limit.

The answer is what follows the last "Answer:" in the response, up to the end of that line; it is
compared with the ground truth as a string after normalisation (dollar signs, \\boxed{}, \\text{},
spaces, thousands separators, trailing zeros, and everything up to a final "=" are removed).

Returned keys, per sample:
  accuracy          1 if the answer is right, else 0.
  overlong_penalty  with L = response_length, Lmax = max_response_length, Lc = overlong_buffer_length:
                    0 if L <= Lmax - Lc; ((Lmax - Lc) - L) / Lc if Lmax - Lc < L <= Lmax; -1 beyond;
                    times overlong_penalty_factor. 0 when max_response_length is None (the default:
                    set it to data.max_response_length in reward_function_kwargs).
  overall           (1 if right else -1) + overlong_penalty.

Self-contained (no math-verify). Format prompt: format_prompts/dapo.jinja.
"""

import re
from decimal import Decimal, InvalidOperation

REWARD_NAME = "dapo"
REWARD_TYPE = "batch"

_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.*)")


def _unwrap(text: str, command: str) -> str:
    """``\\command{x}`` -> ``x`` for every occurrence (braces inside x kept balanced)."""
    head = "\\" + command + "{"
    while (start := text.find(head)) >= 0:
        depth, i = 1, start + len(head)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            break  # unbalanced: leave it
        text = text[:start] + text[start + len(head) : i - 1] + text[i:]
    return text


def normalize_answer(text: str) -> str:
    text = str(text).strip()
    for command in ("boxed", "text", "textbf", "mathrm"):
        text = _unwrap(text, command)
    text = text.split("=")[-1]
    for token in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}"):
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = "".join(text.split()).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            text = format(Decimal(text).normalize(), "f")  # "5.0" -> "5", "2.50" -> "2.5"
    except InvalidOperation:
        pass
    return text


def extract_answer(response: str) -> str | None:
    matches = _ANSWER_LINE.findall(response)
    return matches[-1].strip() if matches else None


def overlong_penalty(length: int, max_length: int | None, buffer: int, factor: float) -> float:
    if max_length is None or length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer * factor
    return -factor


def compute_score(
    reward_inputs: list[dict],
    max_response_length: int | None = None,
    overlong_buffer_length: int = 4096,
    overlong_penalty_factor: float = 1.0,
) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        answer = extract_answer(item["response"])
        right = answer is not None and normalize_answer(answer) == normalize_answer(item["ground_truth"])
        penalty = overlong_penalty(
            item["response_length"], max_response_length, overlong_buffer_length, overlong_penalty_factor
        )
        scores.append({
            "overall": (1.0 if right else -1.0) + penalty,
            "accuracy": float(right),
            "overlong_penalty": penalty,
        })
    return scores
