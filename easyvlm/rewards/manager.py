"""RewardManager: score a batch with user reward functions, run only in worker processes (killed
once a batch outlasts ``timeout``), every output checked; docs/rewards.md, "When a reward function fails"."""

from __future__ import annotations

import logging
import math
import multiprocessing.connection
import numbers
import os
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

from easyvlm.rewards.loader import LoadedReward, RewardFunctionSpec, load_reward_function
from easyvlm.rewards.process import ServingProcess, StartError
from easyvlm.rewards.settings import RewardCallSettings
from easyvlm.rewards.types import RewardError, RewardInput, RewardResult

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class RewardSettings:
    """What a RewardManager needs, built in the driver: the functions (``overall`` is their weighted
    sum) and ``worker.reward``'s call settings."""

    functions: tuple[RewardFunctionSpec, ...]
    calls: RewardCallSettings = RewardCallSettings()

    def __post_init__(self) -> None:
        assert self.functions, "no reward function"
        object.__setattr__(self, "functions", tuple(s.resolved() for s in self.functions))


@dataclass
class _Failure:
    index: int | None  # None: the whole batch call failed
    problem: str


class RewardManager:
    """Loads the reward functions once and scores batches with them.

    >>> manager = RewardManager(RewardSettings((RewardFunctionSpec("reward_functions/synthetic.py:compute_score"),)))
    >>> manager.compute([RewardInput(response="red", response_length=2, ground_truth="red")]).overall
    [1.0]
    """

    def __init__(self, settings: RewardSettings):
        self.settings = settings
        self.rewards: list[LoadedReward] = [load_reward_function(s) for s in settings.functions]
        self.names = _unique([r.name for r in self.rewards])
        self._workers: list[ServingProcess] = []  # started at the first call
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ------------------------------------------------------------------ scoring
    def compute(self, inputs: Sequence[RewardInput]) -> RewardResult:
        """Score B samples: per-sample ``overall`` and sub-scores, and ``reward/...`` metrics.
        Raises RewardError on the first failing sample unless ``on_error="zero"``."""
        raise_now = self.settings.calls.on_error == "raise"
        per_function: list[dict[str, list[float]]] = []
        errors: list[str] = []
        error_count = 0
        dicts = [x.to_dict() for x in inputs]  # each call pickles them: functions cannot edit each other's
        for reward in self.rewards:
            try:
                if not dicts:
                    outcomes = []
                elif reward.reward_type == "batch":
                    outcomes = self._run_batch(reward, dicts, stop_early=raise_now)
                else:
                    outcomes = self._run_sequential(reward, dicts, stop_early=raise_now)
            except StartError as exc:
                raise RewardError(f"reward function {reward.spec}: a reward worker process failed to start: {exc}",
                                  reward.spec) from exc
            scores, failures, failed = _collect(outcomes, len(dicts))
            messages = [_message(reward, f, inputs) for f in failures]
            if messages and raise_now:
                first = failures[0]
                raise RewardError(
                    messages[0] + " Set worker.reward.on_error=zero to score failing samples 0 and keep training "
                    "(they are counted in reward/error_count).",
                    reward.spec,
                    first.index,
                )
            errors += messages
            error_count += failed
            per_function.append(scores)
        if errors:
            logger.warning("%d reward score(s) failed and were set to 0 (on_error=zero); first: %s",
                           error_count, errors[0])
        return _combine(per_function, self.rewards, self.names, len(inputs), errors, error_count)

    def _deadline(self) -> float | None:
        return time.monotonic() + self.settings.calls.timeout

    def _run_batch(self, reward: LoadedReward, dicts: list[dict], stop_early: bool) -> list[dict | _Failure]:
        n = len(dicts)
        worker = self._start_workers()[0]
        deadline = self._deadline()
        status, value = worker.call(("batch", reward.spec, dicts), self.settings.calls.timeout)
        if status == "error":
            return self._isolate(reward, dicts, value, stop_early, deadline)
        if status != "ok":
            return [_Failure(None, self._lost(status, value))] * n
        problem = _check_batch_output(value, n)
        if problem:
            return [_Failure(None, problem)] * n
        return [_check_scores(v, i) for i, v in enumerate(value)]

    def _isolate(
        self, reward: LoadedReward, dicts: list[dict], batch_error: str, stop_early: bool, deadline: float | None
    ) -> list[dict | _Failure]:
        """After a batch call raised: find the failing samples one by one, within the batch's ``timeout``."""
        unlocated = _Failure(None, f"{batch_error} (calling it on one sample at a time did not locate the failing "
                                   "sample)")
        left = None if deadline is None else deadline - time.monotonic()
        status, value = "timeout", None
        if left is None or left > 0:
            status, value = self._start_workers()[0].call(("isolate", reward.spec, (dicts, stop_early)), left)
        if status == "timeout":
            return [_Failure(None, f"{batch_error} (calling it on one sample at a time, to locate the failing sample, "
                                   f"did not end within worker.reward.timeout={self.settings.calls.timeout} s)")] * len(dicts)
        if status != "ok":
            return [unlocated] * len(dicts)
        outcomes: list[dict | _Failure] = []
        for i, (one_status, one_value) in enumerate(value):
            problem = one_value if one_status == "error" else _check_batch_output(one_value, 1)
            outcomes.append(_Failure(i, problem) if problem else _check_scores(one_value[0], i))
        if not any(isinstance(o, _Failure) for o in outcomes):
            return [unlocated] * len(dicts)
        return outcomes + [unlocated] * (len(dicts) - len(outcomes))  # stopped at the first failure

    def _run_sequential(
        self, reward: LoadedReward, dicts: list[dict], stop_early: bool
    ) -> list[dict | _Failure | None]:
        """One sample per call, at most one call per worker process at a time, all within ``timeout``."""
        workers = self._start_workers()
        deadline = self._deadline()
        outcomes: list[dict | _Failure | None] = [None] * len(dicts)
        todo = deque(range(len(dicts)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (sample index, start time)
        while todo or busy:
            if deadline is not None and time.monotonic() >= deadline:
                self._time_out(busy, todo, outcomes)
                break
            self._start_workers()  # again: a worker process may have died
            for slot, worker in enumerate(workers):
                if slot not in busy and todo:
                    i = todo.popleft()
                    try:
                        worker.send(("sequential", reward.spec, dicts[i]))
                    except Exception as exc:  # e.g. an extra column that cannot be pickled
                        problem = f"its input cannot be sent to a worker process ({type(exc).__name__}: {exc})"
                        outcomes[i] = _Failure(i, problem)
                        continue
                    busy[slot] = (i, time.monotonic())
            if not busy:
                continue
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([workers[slot].conn for slot in busy], timeout=wait)
            for slot in [slot for slot in busy if workers[slot].conn in ready]:
                i, _ = busy.pop(slot)
                status, value = workers[slot].receive()
                if status == "ok":
                    outcomes[i] = _check_scores(value, i)
                else:
                    outcomes[i] = _Failure(i, value if status == "error" else self._lost(status, value))
            if stop_early and any(isinstance(o, _Failure) for o in outcomes):
                for slot in busy:  # their answers would arrive during the next call: discard them
                    workers[slot].kill()
                break
        return outcomes

    def _time_out(self, busy: dict[int, tuple[int, float]], todo: deque, outcomes: list) -> None:
        """The batch's ``timeout`` ran out: kill the calls still running, fail the samples not started."""
        now = time.monotonic()
        for slot, (i, start) in busy.items():
            self._workers[slot].kill()
            outcomes[i] = _Failure(i, self._lost("timeout", now - start))
        if todo:  # a suffix of the samples: they are handed out in order
            first, later = todo[0], len(todo) - 1
            which = f"it and the {later} samples after it were" if later else "it was"
            problem = (f"{which} not scored: worker.reward.timeout={self.settings.calls.timeout} s, the time a sequential "
                       "function has for the whole batch, ran out while they waited for a free worker process; "
                       "raise worker.reward.timeout or worker.reward.num_workers")
            not_started = _Failure(first, problem)  # one message for all of them, each counted
            for i in todo:
                outcomes[i] = not_started

    def _lost(self, status: str, detail: Any) -> str:
        """The problem when a call gave no usable answer: "timeout", "died" or "unpicklable"."""
        if status == "timeout" and detail is not None:  # detail: seconds this sample of a sequential call ran
            return (f"the call did not return within worker.reward.timeout={self.settings.calls.timeout} s, the time a "
                    f"sequential function has for the whole batch (this sample ran for {detail:.1f} s of it; its "
                    "worker process was killed and will be restarted)")
        if status == "timeout":
            return (f"the call did not return within worker.reward.timeout={self.settings.calls.timeout} s "
                    "(its worker process was killed and will be restarted)")
        if status == "unpicklable":
            return (f"it returned a value that cannot be sent back from its worker process ({detail}); "
                    "return floats or dicts of floats")
        return (f"its worker process died (exit code {detail}: a crash in native code, os._exit or out of "
                "memory); it will be restarted")

    # ------------------------------------------------------------------ worker processes
    def _start_workers(self) -> list[ServingProcess]:
        if not self._workers:
            specs = list(self.settings.functions)
            self._workers.extend(
                ServingProcess(_setup_worker, (specs,), _handle_request, name=f"easyvlm-reward-worker-{i}")
                for i in range(self.settings.calls.num_workers)
            )
        for w in self._workers:  # the ones a timeout killed are started again here, side by side
            w.launch()
        for w in self._workers:
            w.start()
        return self._workers

    def close(self) -> None:
        """Stop the worker processes (also done when the manager is garbage-collected)."""
        self._finalizer()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stop_workers(workers: list[ServingProcess]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


# ---------------------------------------------------------------------- in the worker process
def _setup_worker(specs: list[RewardFunctionSpec]) -> dict[str, LoadedReward]:
    loaded = [load_reward_function(s) for s in specs]
    return {reward.spec: reward for reward in loaded}


def _handle_request(loaded: dict[str, LoadedReward], request: tuple[str, str, Any]) -> tuple[str, Any]:
    """("batch", spec, [dict, ...]) | ("sequential", spec, dict) -> ("ok", output) | ("error", message);
    ("isolate", spec, (dicts, stop_early)) -> ("ok", [("ok", [output]) | ("error", message), ...])."""
    mode, spec, payload = request
    reward = loaded[spec]
    if mode != "isolate":
        return _call(reward, payload)
    dicts, stop_early = payload
    out = []
    for d in dicts:
        out.append(_call(reward, [d]))
        if stop_early and out[-1][0] == "error":
            break
    return "ok", out


def _call(reward: LoadedReward, arg: Any) -> tuple[str, Any]:
    try:
        return "ok", reward.fn(arg, **reward.kwargs)
    except BaseException as exc:  # SystemExit from a reward file is its failure, not the worker's
        return "error", _describe_exception(exc, reward.spec)


def _describe_exception(exc: BaseException, spec: str) -> str:
    """``it raised ValueError: bad (at math.py:12 in compute_score: return 1/0)``."""
    text = f"it raised {type(exc).__name__}: {exc}"
    path = os.path.realpath(spec.rpartition(":")[0])
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == path]
    if frames:
        f = frames[-1]
        text += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()})"
    return text


# ---------------------------------------------------------------------- checking outputs
def _check_batch_output(value: Any, n: int) -> str | None:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            return f"it returned {len(value)} scores for {n} inputs; a batch reward returns one score per input, " \
                   "in order"
        return None
    hint = ""
    if isinstance(value, (Mapping, numbers.Real)):
        hint = (" If the function scores one sample per call, set REWARD_TYPE = 'sequential' in the file "
                "(or worker.reward.reward_type=sequential).")
    elif hasattr(value, "tolist"):
        hint = " Convert it with .tolist()."
    return f"it returned {_short(value)}, not a list of {n} scores (one per input).{hint}"


def _check_scores(value: Any, index: int) -> dict[str, float] | _Failure:
    """A float or a dict with "overall" -> {key: float}; anything else -> _Failure naming the problem."""
    if isinstance(value, numbers.Real):
        value = {"overall": value}
    if not isinstance(value, Mapping):
        hint = " Convert it with float(...) or .item()." if hasattr(value, "item") else ""
        problem = f"it returned {_short(value)}; a score is a float or a dict with an 'overall' float.{hint}"
        return _Failure(index, problem)
    if "overall" not in value:
        return _Failure(index, f"it returned a dict without 'overall' (keys: {sorted(map(str, value))}); "
                               "every score dict needs an 'overall' float")
    scores = {}
    for key, v in value.items():
        if not isinstance(key, str):
            return _Failure(index, f"it returned a dict with the non-str key {key!r}")
        if not isinstance(v, numbers.Real):
            hint = " Convert it with float(...) or .item()." if hasattr(v, "item") else ""
            return _Failure(index, f"its {key!r} is {_short(v)}, not a float.{hint}")
        if not math.isfinite(v):
            return _Failure(index, f"its {key!r} is {v} (not finite: NaN or infinite)")
        scores[key] = float(v)
    return scores


def _collect(outcomes: list, n: int) -> tuple[dict[str, list[float]], list[_Failure], int]:
    """Per-key lists of B floats (failed samples get 0 for every key), the distinct failures, and the
    number of failed samples. Every sample must return the same keys."""
    keys: list[str] | None = None
    first = -1
    for i, o in enumerate(outcomes):
        if isinstance(o, dict):
            if keys is None:
                keys, first = sorted(o), i
            elif sorted(o) != keys:
                problem = f"it returned the keys {sorted(o)}, but for sample {first} it returned {keys}; every " \
                          "sample must return the same keys"
                outcomes[i] = _Failure(i, problem)
    keys = keys or ["overall"]
    scores = {k: [0.0] * n for k in keys}
    failures: dict[int, _Failure] = {}  # by id: a batch-wide failure is one object shared by all samples
    failed = 0
    for i, o in enumerate(outcomes):
        if isinstance(o, dict):
            for k in keys:
                scores[k][i] = o[k]
        else:  # a _Failure, or None for a sample not run after an earlier failure (on_error=raise)
            failed += 1
            if o is not None:
                failures.setdefault(id(o), o)
    return scores, list(failures.values()), failed


def _message(reward: LoadedReward, failure: _Failure, inputs: Sequence[RewardInput]) -> str:
    where = f"reward function {reward.spec} ({reward.reward_type})"
    problem = failure.problem.rstrip(".") + "."
    if failure.index is None:
        return f"{where} failed on the batch of {len(inputs)} samples: {problem}"
    response = inputs[failure.index].response
    preview = response if len(response) <= 80 else response[:77] + "..."
    return f"{where} failed on sample {failure.index} (response {preview!r}): {problem}"


def _combine(
    per_function: list[dict[str, list[float]]],
    rewards: list[LoadedReward],
    names: list[str],
    n: int,
    errors: list[str],
    error_count: int,
) -> RewardResult:
    if len(per_function) == 1:
        scores = dict(per_function[0])
        scores["overall"] = [rewards[0].weight * v for v in scores["overall"]]
    else:
        scores = {"overall": [sum(r.weight * s["overall"][i] for r, s in zip(rewards, per_function)) for i in range(n)]}
        for name, s in zip(names, per_function):
            scores.update({f"{name}/{k}": v for k, v in s.items()})
    metrics = {f"reward/{k}": (sum(v) / n if n else 0.0) for k, v in scores.items()}
    metrics["reward/error_count"] = float(error_count)
    function_keys = [f"{name}/overall" for name in names] if len(per_function) > 1 else []
    return RewardResult(scores, metrics, errors, function_keys)


def _unique(names: list[str]) -> list[str]:
    """REWARD_NAMEs made unique: a second "math" becomes "math_2"."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
