"""Math answer checking with math-verify, with a timeout that works in any thread: math-verify's own
(``signal.alarm``) in the main thread, elsewhere a helper process killed if late (a thread timeout
cannot stop big-int arithmetic holding the GIL). See docs/rewards.md, "math-verify in threads".
"""

from __future__ import annotations

import math
import threading

from math_verify import parse, verify

from easyvlm.rewards.process import ServingProcess

_helper: ServingProcess | None = None
_helper_lock = threading.Lock()


def extract_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None  # unbalanced braces


def _as_boxed(answer: str) -> str:
    r"""An answer as one ``\boxed{}`` expression, so that math-verify reads all of it as the answer."""
    answer = answer.strip()
    boxed = extract_boxed(answer)
    if boxed is not None:
        answer = boxed
    return "\\boxed{" + answer.strip().strip("$").strip() + "}"


def _equal_main_thread(prediction: str, ground_truth: str, timeout: float) -> bool:
    seconds = max(1, math.ceil(timeout))  # signal.alarm counts whole seconds
    gold = parse(_as_boxed(ground_truth), parsing_timeout=seconds)
    pred = parse(_as_boxed(prediction), parsing_timeout=seconds)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=seconds))


def math_equal(prediction: str, ground_truth: str, timeout: float = 5.0) -> bool:
    r"""True if two answers (bare, ``$...$`` or with ``\boxed{...}``, the last box) are mathematically
    equal by math-verify; a check longer than ``timeout`` seconds counts as not equal. Any thread."""
    prediction, ground_truth = str(prediction), str(ground_truth)
    if not prediction.strip() or not ground_truth.strip():
        return False
    if threading.current_thread() is threading.main_thread():
        return _equal_main_thread(prediction, ground_truth, timeout)
    global _helper
    with _helper_lock:  # one helper process per process; callers take turns
        if _helper is None:
            _helper = ServingProcess(_helper_setup, (), _helper_handle, name="easyvlm-mathcheck")
        # parse + parse + verify, each with its own alarm, plus the helper's start-up
        status, value = _helper.call((prediction, ground_truth, timeout), timeout=3 * max(1, math.ceil(timeout)) + 1)
    return status == "ok" and bool(value)


def _helper_setup() -> None:
    return None


def _helper_handle(_state: None, request: tuple[str, str, float]) -> tuple[str, bool]:
    return "ok", _equal_main_thread(*request)
