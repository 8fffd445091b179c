"""worker.reward.timeout bounds each reward function's whole batch: a function that hangs (on one
sample or on all of them) is stopped within the timeout, not after one timeout per sample, and
what was scored in time is kept. Real worker processes, real hangs (hence slow).

The wall-time bound is TIMEOUT + 5 s: the manager itself needs well under a second past the timeout
(kill a process, collect the outcomes); the rest is room for a shared 2-core machine. Calling a
sequential function one timeout per sample, as before, takes 8 x 2 s = 16 s for 8 hung samples on
one worker and 4 rounds x 2 s = 8 s on two, both past the bound.
"""

from __future__ import annotations

import re
import time

import pytest
from rewards_testing import inp, manager, write_file

from easyvlm.rewards import RewardError, RewardFunctionSpec

pytestmark = pytest.mark.slow

TIMEOUT = 2.0
BOUND = TIMEOUT + 5.0

HANGING = '''
import time


def _one(item):
    if item["response"] == "hang":
        time.sleep(1e9)
    return float(item["response"] == item["ground_truth"])


def batch(items):
    return [_one(x) for x in items]


def seq(item):
    return _one(item)


def raises_then_hangs(items):
    if len(items) > 1:
        raise RuntimeError("batch too big")
    time.sleep(1e9)


def twos(items):
    return [2.0 for _ in items]
'''


@pytest.fixture(scope="module")
def hanging(tmp_path_factory) -> str:
    return write_file(tmp_path_factory.mktemp("hanging"), "hanging.py", HANGING)


def seq_spec(path: str) -> RewardFunctionSpec:
    return RewardFunctionSpec(f"{path}:seq", reward_type="sequential")


def timed_compute(m, inputs):
    """(the RewardResult or the RewardError raised, seconds) of one compute call, timed after the
    worker processes have started (their start has its own limit, START_TIMEOUT, not the timeout)."""
    assert m.compute([inp("a", "a")]).errors == []  # starts the workers
    start = time.monotonic()
    try:
        outcome = m.compute(inputs)
    except RewardError as exc:
        outcome = exc
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("num_workers", [1, 2])
def test_sequential_function_hanging_on_every_sample_stops_at_the_timeout(hanging, num_workers):
    with manager(seq_spec(hanging), timeout=TIMEOUT, on_error="zero", num_workers=num_workers) as m:
        result, seconds = timed_compute(m, [inp("hang", "a")] * 8)
        assert m.compute([inp("a", "a")]).overall == [1.0]  # new worker processes took over
    assert seconds < BOUND, seconds
    assert result.overall == [0.0] * 8 and result.metrics["reward/error_count"] == 8.0
    # samples 0 .. num_workers-1 were running when the timeout ran out; the others were waiting
    running = [f"failed on sample {i} (response 'hang'): the call did not return within worker.reward.timeout=2.0 s, "
               "the time a sequential function has for the whole batch (this sample ran for " for i in range(num_workers)]
    waiting = (f"failed on sample {num_workers} (response 'hang'): it and the {7 - num_workers} samples after it were "
               "not scored: worker.reward.timeout=2.0 s, the time a sequential function has for the whole batch, ran out "
               "while they waited for a free worker process; raise worker.reward.timeout or worker.reward.num_workers.")
    assert len(result.errors) == num_workers + 1
    for error, expected in zip(result.errors, running + [waiting]):
        assert expected in error, error
    for error in result.errors[:num_workers]:
        # each was sent as the timeout started, so it ran all of it: 2 s, less up to 0.5 s for a busy machine
        ran = float(re.search(r"this sample ran for ([0-9.]+) s", error).group(1))
        assert TIMEOUT - 0.5 <= ran < BOUND, error


def test_sequential_function_hanging_on_one_sample_keeps_the_other_scores(hanging):
    responses = ["a", "hang", "x", "a", "y", "a"]  # ground truth "a": right, hung, wrong, right, wrong, right
    with manager(seq_spec(hanging), timeout=TIMEOUT, on_error="zero", num_workers=2) as m:
        result, seconds = timed_compute(m, [inp(r, "a") for r in responses])
    assert seconds < BOUND, seconds
    assert result.overall == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]  # the other worker scored all the others
    assert result.metrics["reward/error_count"] == 1.0
    assert result.metrics["reward/overall"] == 0.5  # 3 right of 6
    assert len(result.errors) == 1 and "failed on sample 1 (response 'hang')" in result.errors[0]


def test_with_one_worker_the_samples_queued_behind_a_hung_one_are_not_scored(hanging):
    """The price of bounding the batch (docs/rewards.md): the one worker is busy until the timeout."""
    with manager(seq_spec(hanging), timeout=TIMEOUT, on_error="zero", num_workers=1) as m:
        result, seconds = timed_compute(m, [inp("a", "a"), inp("hang", "a"), inp("a", "a")])
    assert seconds < BOUND, seconds
    assert result.overall == [1.0, 0.0, 0.0] and result.metrics["reward/error_count"] == 2.0
    assert "failed on sample 2 (response 'a'): it was not scored: worker.reward.timeout=2.0 s" in result.errors[1]


@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_on_error_raise_names_the_file_the_sample_and_the_timeout_key(hanging, mode):
    func = "batch" if mode == "batch" else "seq"
    spec = RewardFunctionSpec(f"{hanging}:batch") if mode == "batch" else seq_spec(hanging)
    with manager(spec, timeout=TIMEOUT, num_workers=2) as m:
        error, seconds = timed_compute(m, [inp("a", "a"), inp("hang", "a"), inp("hang", "a"), inp("hang", "a")])
    assert seconds < BOUND, seconds
    assert isinstance(error, RewardError), error
    where = "the batch of 4 samples" if mode == "batch" else "sample 1 (response 'hang')"
    assert str(error).startswith(f"reward function {hanging}:{func} ({mode}) failed on {where}: the call did not "
                                 "return within worker.reward.timeout=2.0 s")
    assert (error.spec, error.sample_index) == (f"{hanging}:{func}", None if mode == "batch" else 1)


def test_batch_function_hanging_loses_its_batch_and_nothing_else(hanging):
    """A batch function that hangs has scored nothing: its whole batch scores 0, counted; the other
    reward function's scores are kept."""
    specs = (RewardFunctionSpec(f"{hanging}:batch"), RewardFunctionSpec(f"{hanging}:twos", weight=0.5))
    with manager(*specs, timeout=TIMEOUT, on_error="zero") as m:
        result, seconds = timed_compute(m, [inp("a", "a"), inp("hang", "a"), inp("x", "a")])
    assert seconds < BOUND, seconds
    assert result.scores["hanging/overall"] == [0.0, 0.0, 0.0]
    assert result.scores["hanging_2/overall"] == [2.0, 2.0, 2.0]
    assert result.overall == [1.0, 1.0, 1.0]  # 1 * 0 + 0.5 * 2.0
    assert result.metrics["reward/error_count"] == 3.0
    assert result.errors == [f"reward function {hanging}:batch (batch) failed on the batch of 3 samples: the call did "
                             "not return within worker.reward.timeout=2.0 s (its worker process was killed and will "
                             "be restarted)."]


def test_locating_the_failing_sample_shares_the_batch_timeout(hanging):
    """The batch call raises at once, the single-sample calls that would locate the failure hang: they
    get what is left of the timeout, not a timeout of their own."""
    with manager(f"{hanging}:raises_then_hangs", timeout=TIMEOUT, on_error="zero") as m:
        start = time.monotonic()
        result = m.compute([inp("a"), inp("b")])
        seconds = time.monotonic() - start
    assert seconds < BOUND, seconds
    assert result.overall == [0.0, 0.0] and result.metrics["reward/error_count"] == 2.0
    assert "failed on the batch of 2 samples: it raised RuntimeError: batch too big" in result.errors[0]
    assert result.errors[0].endswith("(calling it on one sample at a time, to locate the failing sample, did not end "
                                     "within worker.reward.timeout=2.0 s).")
