"""Stateful environments: ``worker.rollout.environment=path/file.py:ClassName``.

For tasks whose next observation depends on the last action (games, GUI episodes, simulations).
The class is instantiated once per sample with no arguments, then

- ``reset(row) -> None``: the sample's row (its extra columns by name, plus ``ground_truth``); the
  prompt the model sees first is the row's prompt, built by the data pipeline as usual;
- ``step(action) -> (observation, done)`` or ``(observation, done, reward)``: ``action`` is the
  text of the model's turn; ``observation`` is text, a PIL image, a list of both, or None; it is
  shown to the model as a user message. ``done`` ends the sample; the rewards of its steps are
  summed and given to the reward function as ``environment_reward``.

A step that raises or takes longer than ``worker.rollout.tool_timeout`` ends its sample with the
error recorded (counted in the metrics), not the run.
"""

from __future__ import annotations

import inspect
from typing import Any

from easyvlm.agents.tools import ToolError, ToolResult, normalise_result, run_with_timeout
from easyvlm.utils.plugins import PluginError, load_plugin


def load_environment(spec: str) -> type:
    """The class ``file.py:ClassName`` names, checked for ``reset`` and ``step``."""
    try:
        cls, _ = load_plugin(spec)
    except PluginError as err:
        raise ToolError(f"worker.rollout.environment: {err}") from err
    if not inspect.isclass(cls):
        raise ToolError(f"worker.rollout.environment: {spec} is a {type(cls).__name__}, not a class with reset() and step()")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ToolError(f"worker.rollout.environment: class {cls.__name__} ({spec}) has no {' and no '.join(missing)} method")
    return cls


def environment_step(env: Any, action: str, timeout: float) -> tuple[ToolResult, bool, float]:
    """(observation, done, reward) of ``env.step(action)``; an exception, a step longer than
    ``timeout`` seconds or a malformed return ends the sample (done) with ``error`` set."""
    out, error = run_with_timeout(lambda: env.step(action), timeout, "environment step")
    if error is not None:
        return ToolResult(error=error), True, 0.0
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        return ToolResult(error=f"environment step must return (observation, done[, reward]), got {type(out).__name__}"), True, 0.0
    observation, done, reward = (*out, 0.0) if len(out) == 2 else out
    try:
        reward = float(reward or 0.0)
    except (TypeError, ValueError):
        return ToolResult(error=f"environment reward must be a number, got {reward!r}"), True, 0.0
    result = ToolResult() if observation is None else normalise_result(observation, "environment")
    return result, bool(done) or not result.ok, reward
