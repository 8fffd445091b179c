"""math_equal: math-verify answers, and its timeout in the main thread and in other threads
(math-verify's own signal-based timeout raises outside the main thread)."""

from __future__ import annotations

import threading
import time

import pytest

from easyvlm.rewards.mathcheck import extract_boxed, math_equal

# 10^(10^10) has ten billion digits: sympy's evaluation runs for hours inside big-int arithmetic.
HANGS = "10^{10^{10}}"


def in_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a new thread; returns its result (or raises its exception)."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the call did not return within 60 s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_extract_boxed():
    assert extract_boxed("so \\boxed{\\frac{1}{2}} or \\boxed{x^{2}+1}") == "x^{2}+1"  # the last, nested braces kept
    assert extract_boxed("\\boxed{}") == ""
    assert extract_boxed("\\boxed{1") is None  # unbalanced
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "prediction, truth, equal",
    [
        ("0.5", "\\frac{1}{2}", True),
        ("\\boxed{3}", "3.0", True),
        ("$\\frac12$", "0.5", True),
        ("x = 2", "2", True),
        ("\\sqrt{2}", "2^{1/2}", True),
        ("4", "3", False),
        ("", "3", False),
        ("3", "", False),
    ],
)
def test_math_equal_in_main_thread(prediction, truth, equal):
    assert math_equal(prediction, truth) is equal


def test_math_equal_times_out_in_main_thread():
    start = time.monotonic()
    assert math_equal(HANGS, "1", timeout=1.0) is False
    assert time.monotonic() - start < 10


@pytest.mark.slow  # starts the helper process
def test_math_equal_in_other_threads():
    from math_verify import parse

    # the problem being solved: math-verify's default timeout refuses to run outside the main thread
    with pytest.raises(ValueError, match="doesn't support threaded environment"):
        in_thread(parse, "\\boxed{1}")
    assert in_thread(math_equal, "\\frac{2}{4}", "0.5") is True
    assert in_thread(math_equal, "5", "4") is False
    start = time.monotonic()
    assert in_thread(math_equal, HANGS, "1", timeout=1.0) is False
    assert time.monotonic() - start < 20
    assert in_thread(math_equal, "2", "2") is True  # still works after a timeout
