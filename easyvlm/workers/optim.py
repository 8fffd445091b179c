"""AdamW and the learning-rate schedule: linear warm-up, then constant or cosine decay.

The schedule is a pure function of the training step (``lr_multiplier``); the scheduler advances
once per ``update_policy`` / ``update_critic`` call (one trainer step), as in EasyR1 and verl.

Departure from transformers' ``get_*_schedule_with_warmup``: warm-up step s uses (s + 1) / W of
the peak rate, not s / W, so the first update is not wasted at a learning rate of 0.
"""

from __future__ import annotations

import logging
import math
import warnings
from functools import partial
from typing import Any, Iterable

import torch

logger = logging.getLogger(__name__)


def warmup_steps_for(total_steps: int, lr_warmup_ratio: float = 0.0, lr_warmup_steps: int | None = None) -> int:
    """``lr_warmup_steps`` if given, else ``int(lr_warmup_ratio * total_steps)`` (EasyR1's rule)."""
    if lr_warmup_steps is not None and lr_warmup_steps >= 0:
        return int(lr_warmup_steps)
    return int(lr_warmup_ratio * total_steps)


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    scheduler_type: str = "constant",
    min_lr_ratio: float | None = None,
) -> float:
    """Factor on the peak learning rate at 0-based ``step``.

    warm-up (step < W): (step + 1) / W.
    constant: 1.
    cosine:   r + (1 - r) * (1 + cos(pi * p)) / 2, p = (step - W) / (total_steps - W) clipped to
              [0, 1], r = min_lr_ratio (default 0): 1 right after warm-up, r at step total_steps
              (transformers' convention: the last step, total_steps - 1, is just above r).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler_type == "constant":
        return 1.0
    if scheduler_type == "cosine":
        floor = 0.0 if min_lr_ratio is None else float(min_lr_ratio)
        progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown optim.lr_scheduler_type {scheduler_type!r}; valid: 'constant', 'cosine'")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim_config: Any) -> torch.optim.Optimizer:
    """AdamW over ``params`` (pass only trainable ones) from ``optim`` (lr, betas, weight_decay, strategy)."""
    strategy = getattr(optim_config, "strategy", "adamw")
    if strategy == "adamw_bf16":
        logger.warning("optim.strategy='adamw_bf16' runs as 'adamw' (float32 optimizer states) in easyvlm")
    elif strategy != "adamw":
        raise ValueError(f"unknown optim.strategy {strategy!r}; valid: 'adamw', 'adamw_bf16'")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (everything frozen?); nothing to optimise")
    return torch.optim.AdamW(
        params,
        lr=float(optim_config.lr),
        betas=tuple(getattr(optim_config, "betas", (0.9, 0.999))),
        weight_decay=float(getattr(optim_config, "weight_decay", 0.01)),
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim_config: Any, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose factor is :func:`lr_multiplier` (step 0 = the first update)."""
    warmup = warmup_steps_for(
        total_steps, getattr(optim_config, "lr_warmup_ratio", 0.0), getattr(optim_config, "lr_warmup_steps", None)
    )
    fn = partial(
        lr_multiplier,
        total_steps=total_steps,
        warmup_steps=warmup,
        scheduler_type=getattr(optim_config, "lr_scheduler_type", "constant"),
        min_lr_ratio=getattr(optim_config, "min_lr_ratio", None),
    )
    fn(0)  # fail now, not at the first step, on a bad scheduler type
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule by one training step (also after a skipped optimizer step, which makes
    torch warn that the scheduler stepped before the optimizer: expected here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
