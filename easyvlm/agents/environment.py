"""Stateful environments: ``worker.rollout.environment=path/file.py:ClassName``.

For tasks whose next observation depends on the last action (games, GUI episodes, simulations).
The class is instantiated once per sample with no arguments, then

- ``reset(row) -> None`` or an info dict: the sample's row (its extra columns by name, plus
  ``ground_truth``); the prompt the model sees first is the row's prompt, built by the data pipeline
  as usual;
- ``step(action) -> (observation, done)``, ``(observation, done, reward)`` or ``(observation, done,
  reward, info)``: ``action`` is the text of the model's turn; ``observation`` is text, a PIL image,
  a list of both, or None; it is shown to the model as a user message. ``done`` ends the sample; the
  rewards of its steps are summed and given to the reward function as ``environment_reward`` (and
  kept per step for step-level estimators).

``info`` (optional, a dict) may say ``state_key``: what identifies the state the environment is in
(a str, int or bytes, or anything whose ``repr`` does), the anchor state of the next step (GiGPO's
step groups). Without it the state after a step is the observation's text and image bytes, and the
state after ``reset`` is the row's prompt (the same for every sample of a prompt). The last step's
info reaches the reward function as ``environment_info`` (``success``: whether the task was solved).

A step that raises or takes longer than ``worker.rollout.tool_timeout`` ends its sample with the
error recorded (counted in the metrics), not the run.
"""

from __future__ import annotations

import hashlib
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


def environment_step(env: Any, action: str, timeout: float) -> tuple[ToolResult, bool, float, dict]:
    """(observation, done, reward, info) of ``env.step(action)``; an exception, a step longer than
    ``timeout`` seconds or a malformed return ends the sample (done) with ``error`` set."""
    out, error = run_with_timeout(lambda: env.step(action), timeout, "environment step")
    if error is not None:
        return ToolResult(error=error), True, 0.0, {}
    if not isinstance(out, tuple) or len(out) not in (2, 3, 4):
        return ToolResult(error="environment step must return (observation, done[, reward[, info]]), got "
                                f"{type(out).__name__}"), True, 0.0, {}
    observation, done, reward, info = (*out, *(0.0, None)[len(out) - 2:])  # the defaults of what is left out
    try:
        reward = float(reward or 0.0)
    except (TypeError, ValueError):
        return ToolResult(error=f"environment reward must be a number, got {reward!r}"), True, 0.0, {}
    if info is not None and not isinstance(info, dict):
        return ToolResult(error=f"environment info must be a dict, got {type(info).__name__}"), True, 0.0, {}
    result = ToolResult() if observation is None else normalise_result(observation, "environment")
    return result, bool(done) or not result.ok, reward, dict(info or {})


RESET_STATE = "(the row's prompt)"  # the state after a reset without a state_key


def state_anchor(info: dict, observation: ToolResult | None = None) -> int:
    """An int64 identity of the environment's state: ``info["state_key"]`` when given, else the
    observation's text and image bytes, else (after a reset) ``RESET_STATE``. blake2b, not
    ``hash()``: the same in every process."""
    digest = hashlib.blake2b(digest_size=8)
    if "state_key" in info:
        key = info["state_key"]
        digest.update(key if isinstance(key, bytes) else repr(key).encode())
    elif observation is not None:
        digest.update(f"{observation.text!r} {observation.error!r}".encode())
        for image in observation.images:
            digest.update(f"{image.mode} {image.size}".encode())
            digest.update(image.tobytes())
    else:
        digest.update(RESET_STATE.encode())
    return int.from_bytes(digest.digest(), "little", signed=True)
