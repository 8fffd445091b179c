"""The multi-turn rollout's settings, declared once: the tools and environment a sample's turns
may use and the turn limits (the keys ``worker.rollout.tools`` ... ``tool_timeout``, which the
config schema composes in their place), and the names of the tools easyvlm ships. Torch-free (and
free of PIL): the config check imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SHIPPED_TOOLS: tuple[str, ...] = ("image_zoom", "calculator")
"""The tools easyvlm ships (easyvlm.agents.shipped), by the names ``worker.rollout.tools`` takes."""


@dataclass(frozen=True)
class AgentSettings:
    """Multi-turn rollouts (``worker.rollout.tools`` or ``environment``): the driver runs the turns
    (``easyvlm.agents.loop``); the plan resolves the paths and loads every tool first."""

    tools: list[str] = field(default_factory=list)
    """easyvlm extra. Tools the model may call over several turns: shipped ones by name
    (`image_zoom`, `calculator`) or your functions as `path/file.py:func`; the chat template shows
    their schemas, tool results (text or images) come back as the template's tool messages, and only
    the model's tokens are trained. docs/agents.md."""
    environment: Optional[str] = None
    """easyvlm extra. A stateful environment `path/file.py:ClassName` with `reset(row)` and
    `step(action) -> (observation, done[, reward])`: the model's turns are its actions (instead of
    `tools`). docs/agents.md."""
    max_turns: int = 4
    """easyvlm extra. Most model turns per sample with `tools` or an `environment`."""
    max_tokens_per_turn: Optional[int] = None
    """easyvlm extra. Most tokens the model writes in one turn with `tools` or an `environment`;
    None = what is left of `data.max_response_length`, which bounds the whole trajectory (tool
    tokens included)."""
    tool_timeout: float = 10.0
    """easyvlm extra. Seconds a tool call or environment step may take; a call that takes longer is
    answered with an error message."""
