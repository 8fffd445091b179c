"""The run plan's slice for the generative judge (`JudgeSpec`, ``worker.judge``). A plain frozen
dataclass: no behaviour. ``easyvlm.plan.roles`` makes it; ``easyvlm.rewards.judge`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easyvlm.rollout.specs import RolloutSpec


@dataclass(frozen=True)
class JudgeSpec:
    """The generative judge of ``worker.judge`` (easyvlm.rewards.judge)."""

    rollout: RolloutSpec
    """The judge's engine, greedy, ``max_tokens`` long."""
    data: Any
    """A DataConfig that encodes judge prompts (prompt_key ``prompt``, the judge's pixel limits)."""
    tokenizer: Any
    processor: Any
    template: str
    """Absolute path of the Jinja template."""
    parser: str
    """Resolved ``/abs/file.py:func``."""
    num_workers: int
    timeout: float
    on_error: str
    cache_size: int
