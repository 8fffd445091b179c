"""Stateful environments (``worker.rollout.environment=path/file.py:ClassName``; the interface:
docs/agents.md, "Writing an environment"). One that raises, times out or returns something malformed
ends its sample (out of the loss), not the run. Samples step at once in threads."""

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


def environment_reset(cls: type, row: dict, timeout: float) -> tuple[Any, dict, str | None]:
    """(instance, info of ``cls().reset(row)``, None), or (None, {}, why it failed) past ``timeout`` s."""
    def start() -> tuple[Any, Any]:
        env = cls()
        return env, env.reset(row)

    out, error = run_with_timeout(start, timeout, "environment reset")
    if error is not None:
        return None, {}, error
    env, info = out
    return env, dict(info) if isinstance(info, dict) else {}, None


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
    result = ToolResult() if observation is None else normalise_result(
        observation, "environment step", "an observation is text, a PIL image, a list of both, or None")
    return result, bool(done) or not result.ok, reward, dict(info or {})


RESET_STATE = "(the row's prompt)"  # the state after a reset without a state_key


def state_anchor(info: dict, observation: ToolResult | None = None) -> int:
    """An int64 identity of the state for GiGPO's step groups: blake2b of ``info["state_key"]``, else
    of the observation's text and image bytes, else ``RESET_STATE``."""
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
