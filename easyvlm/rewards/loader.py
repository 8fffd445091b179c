"""Load a reward function from ``path/to/file.py:func`` and check its signature before any sample is
scored. ``REWARD_NAME`` (default: the file's stem) and ``REWARD_TYPE`` are EasyR1's."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from easyvlm.rewards.types import RewardError
from easyvlm.utils.plugins import PluginError, load_plugin, parse_plugin_spec, read_plugin_source

DEFAULT_FUNCTION_NAME = "main"  # EasyR1's default when the spec has no ":func"
REWARD_TYPES = ("batch", "sequential")


@dataclass(frozen=True)
class RewardFunctionSpec:
    """One reward function as the config names it; ``reward_type`` None: the file's ``REWARD_TYPE``;
    ``source``: the file's text, which the reward processes run (they need no copy of the file)."""

    reward_function: str
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    reward_type: str | None = None
    source: str | None = field(default=None, repr=False, compare=False)

    def resolved(self) -> "RewardFunctionSpec":
        """The spec with an absolute path, function name and the file's text; call it in the driver."""
        try:
            parsed = parse_plugin_spec(self.reward_function, DEFAULT_FUNCTION_NAME)
        except PluginError as exc:
            raise RewardError(f"reward function {self.reward_function!r}: {exc}", self.reward_function) from exc
        source = self.source if self.source is not None else read_plugin_source(str(parsed))
        return RewardFunctionSpec(str(parsed), dict(self.reward_function_kwargs), self.weight, self.reward_type, source)


@dataclass(frozen=True)
class LoadedReward:
    """A reward function ready to call: ``fn(inputs, **kwargs)`` (batch) or ``fn(input, **kwargs)``."""

    fn: Callable[..., Any]
    spec: str  # "/abs/path/file.py:func", for messages and for worker processes to load it again
    name: str
    reward_type: str
    kwargs: dict[str, Any]
    weight: float


def load_reward_function(spec: RewardFunctionSpec) -> LoadedReward:
    """Import the file, find the function, read REWARD_NAME / REWARD_TYPE, check the signature.
    Raises RewardError naming the file and function on any problem."""
    spec = spec.resolved()
    where = f"reward function {spec.reward_function}"
    try:
        fn, module = load_plugin(spec.reward_function, DEFAULT_FUNCTION_NAME, spec.source)
    except PluginError as exc:
        raise RewardError(f"{where}: {exc}", spec.reward_function) from exc

    reward_type = spec.reward_type or getattr(module, "REWARD_TYPE", "batch")
    if reward_type not in REWARD_TYPES:
        source = "worker.reward.reward_type" if spec.reward_type else f"REWARD_TYPE in {Path(module.__file__).name}"
        message = f"{where}: {source} is {reward_type!r}; use one of {list(REWARD_TYPES)}"
        raise RewardError(message, spec.reward_function)
    name = getattr(module, "REWARD_NAME", None) or Path(spec.reward_function.partition(":")[0]).stem
    if not isinstance(name, str):
        raise RewardError(f"{where}: REWARD_NAME must be a str, got {type(name).__name__}", spec.reward_function)
    check_signature(fn, reward_type, spec.reward_function_kwargs, spec.reward_function)
    kwargs = dict(spec.reward_function_kwargs)
    return LoadedReward(fn, spec.reward_function, name, reward_type, kwargs, float(spec.weight))


def check_signature(fn: Callable[..., Any], reward_type: str, kwargs: dict[str, Any], spec: str) -> None:
    """Check that ``fn(<one positional argument>, **kwargs)`` is a valid call; ``spec`` names it."""
    where = f"reward function {spec}"
    if inspect.iscoroutinefunction(fn):
        raise RewardError(f"{where} is an async function; reward functions must be plain functions", spec)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C functions have none: nothing to check
        return
    arg = "reward_inputs: list[dict]" if reward_type == "batch" else "reward_input: dict"
    try:
        signature.bind(None, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__name__", "func")
        raise RewardError(
            f"{where}: its signature {name}{signature} does not accept the call {name}({arg}"
            f"{', **reward_function_kwargs' if kwargs else ''}) ({exc}). A {reward_type} reward function takes "
            f"exactly one positional argument ({arg}); every key of reward_function_kwargs={kwargs} must be one "
            f"of its keyword parameters.",
            spec,
        ) from None
