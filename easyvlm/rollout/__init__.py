"""Rollout: sample responses for prompt Batches and sync weights. Names load on first use, so pure
modules (``staleness``) import without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["RolloutEngine", "build_rollout", "sampling_with_overrides"]


def __getattr__(name: str) -> Any:
    if name in ("RolloutEngine", "sampling_with_overrides"):
        from easyvlm.rollout import base

        return getattr(base, name)
    if name == "build_rollout":
        from easyvlm.rollout.factory import build_rollout

        return build_rollout
    raise AttributeError(f"module 'easyvlm.rollout' has no attribute {name!r}")
