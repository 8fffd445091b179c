"""The reward sections, declared once: ``worker.reward`` (`RewardConfig`, its ``reward_functions``
entries `RewardFunctionConfig`) and ``worker.judge`` (`JudgeConfig`), which the config schema holds
as they are. How the reward functions and the generative judge are called, the keys
``worker.reward.timeout``, ``on_error`` and ``num_workers`` and ``worker.judge.num_workers`` ...
``cache_size``, are spliced into them in their place and read whole by the reward manager and the
judge (``RewardSettings.calls``, ``JudgeSpec.calls``). Torch-free: the config check imports
this module."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.utils.compose import fields_of

ON_ERROR = ("raise", "zero")


@dataclass(frozen=True)
class RewardCallSettings:
    """Time limit, failure policy and worker processes of the reward calls (easyvlm.rewards.manager)."""

    timeout: float = 300.0
    """easyvlm extra. Seconds a reward function may take to score one batch (a sequential function: all
    its samples); samples not scored by then fail."""
    on_error: Literal["raise", "zero"] = "raise"
    """easyvlm extra. A reward call that raises or times out: `raise` stops training with the
    sample; `zero` scores the sample 0 and counts it in the logs."""
    num_workers: int = 1
    """easyvlm extra. Processes that run a sequential reward function in parallel."""

    def __post_init__(self) -> None:
        found = RewardCallSettings.problems(self)
        if found:
            raise ValueError("; ".join(f"worker.reward.{key} {message}" for key, message in found))

    @staticmethod
    def problems(s: Any) -> list[tuple[str, str]]:
        """(key under ``worker.reward``, message) for each rule these values break (``s``: this class
        or the config section that composes it). ``on_error``'s values are the type check's."""
        found = []
        if not (isinstance(s.timeout, (int, float)) and math.isfinite(s.timeout) and s.timeout > 0):
            found.append(("timeout", f"must be > 0, got {s.timeout}"))
        if not s.num_workers >= 1:
            found.append(("num_workers", f"must be >= 1, got {s.num_workers}"))
        if s.on_error not in ON_ERROR:
            found.append(("on_error", f"must be one of {', '.join(ON_ERROR)}, got {s.on_error!r}"))
        return found


@dataclass(frozen=True)
class JudgeCallSettings:
    """How the generative judge is called (easyvlm.rewards.judge): the keys ``worker.judge.num_workers``
    ... ``cache_size``."""

    num_workers: int = 1
    """Judge engines (Ray actors, one CPU or GPU each); the step's samples are split over them."""
    timeout: float = 300.0
    """Seconds one engine may take for its share of a step."""
    on_error: Literal["raise", "zero"] = "raise"
    """A verdict that does not parse, or a timeout: `raise` stops with the sample; `zero` scores it
    0 and counts it (judge/parse_failures, judge/timeouts)."""
    cache_size: int = 10000
    """Verdicts remembered (by judge prompt, images and response); 0 = no cache."""

    @staticmethod
    def problems(s: Any) -> list[tuple[str, str]]:
        """(key under ``worker.judge``, message) for each rule these values break."""
        found = [(key, f"must be > 0, got {getattr(s, key)}") for key in ("num_workers", "timeout")
                 if not (math.isfinite(getattr(s, key)) and getattr(s, key) > 0)]
        if not s.cache_size >= 0:
            found.append(("cache_size", f"must be >= 0, got {s.cache_size}"))
        return found


@dataclass(frozen=True)
class RewardFunctionConfig:
    reward_function: str = ""
    """`path/to/file.py:func` (without `:func` the function is `main`)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function."""
    weight: float = 1.0
    """Weight of this function's `overall` in the combined `overall`."""


@dataclass(frozen=True)
@fields_of(RewardCallSettings, after="num_cpus", read_as="calls")
class RewardConfig:
    reward_type: Optional[Literal["batch", "sequential"]] = None
    """batch: the function gets the list of all samples; sequential: one sample per call. None =
    the file's `REWARD_TYPE` constant, else batch. Default differs from EasyR1 ("batch"): the
    reward file knows how it wants to be called."""
    reward_function: Optional[str] = None
    """`path/to/file.py:func` (relative to the working directory; without `:func` the function is
    `main`)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the reward function."""
    skip_special_tokens: bool = True
    """Decode responses without special tokens before scoring."""
    num_cpus: int = 1
    """CPUs reserved for the reward actor."""
    # here: how the functions are called, timeout ... num_workers (RewardCallSettings)
    reward_functions: list[RewardFunctionConfig] = field(default_factory=list)
    """easyvlm extra. Several reward functions: when non-empty, `overall` is the weighted sum of
    their `overall`s and `reward_function` must be unset."""


@dataclass(frozen=True)
@fields_of(JudgeCallSettings, after="max_pixels", read_as="calls")
class JudgeConfig:
    enable: bool = False
    """easyvlm extra. Score every response with a generative judge: a VLM reads the template
    below and writes a verdict, which `parser` turns into a score. It reaches reward functions as
    `judge_score`; `reward_functions/judge.py:compute_score` returns it as the reward."""
    model_path: Optional[str] = None
    """The judge model (a generation model, like the policy's): a local directory, a hub id or a
    `builtin:` model."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the judge model's repository."""
    engine: Literal["vllm", "hf"] = "vllm"
    """The judge's generation engine (greedy)."""
    template: Optional[str] = None
    """Jinja file of the judge's prompt, with `question` (the row's prompt, `<image>` placeholders:
    the sample's images), `response`, `ground_truth`, `num_images`; e.g.
    format_prompts/judge.jinja."""
    parser: Optional[str] = None
    """`path/to/file.py:func` turning the verdict into a score: `func(verdict: str, sample: dict)
    -> float`; raise for a verdict that does not parse (e.g. reward_functions/judge.py:parse_yes_no)."""
    max_tokens: int = 16
    """Verdict tokens."""
    max_prompt_length: int = 1024
    """Judge prompt tokens (images included); longer prompts fail as a judge error."""
    # None, not data.min_pixels' default: the judge is another model, whose processor knows its own limits
    min_pixels: Optional[int] = None
    """Pixel limits of the judge's images; None = the judge processor's own."""
    max_pixels: Optional[int] = None
    """See `min_pixels`."""
    # here: how the judge is called, num_workers ... cache_size (JudgeCallSettings)
