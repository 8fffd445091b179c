"""Optimizers (``optim.strategy``: ``adamw``, ``adamw_bf16`` = :class:`AdamWBF16`; docs/workers.md,
"FSDP2") and the learning-rate schedule, advanced once per update call as in EasyR1 and verl."""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from easyvlm.workers.settings import OptimConfig

# Parameters of these dtypes get a Kahan compensation buffer: adding a small update to them in
# their own precision would lose it (a bfloat16 weight of 1.0 ignores any change below 2**-9).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _local(t: Tensor) -> Tensor:
    """The local shard of an FSDP2 DTensor (in-place writes reach the DTensor), else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def adamw_bf16_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    compensation: Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of one tensor, in place, as torch.optim.AdamW computes it (arXiv:1412.6980 Alg. 1,
    decoupled weight decay arXiv:1711.05101), in float32 with the moments stored in bfloat16.
    ``compensation`` (Kahan summation, arXiv:2010.06192) keeps what rounding the new parameter lost
    for the next update; None for float32 parameters."""
    g = grad.float()
    m = exp_avg.to(torch.float32, copy=True).mul_(beta1).add_(g, alpha=1 - beta1)
    v = exp_avg_sq.to(torch.float32, copy=True).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg.copy_(m)  # rounds to the nearest bfloat16
    exp_avg_sq.copy_(v)
    denom = v.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
    delta = m.div_(denom).mul_(-lr / (1 - beta1**step))  # -lr * m_hat / (sqrt(v_hat) + eps)
    p = param.float()  # a copy for low-precision parameters, param itself for float32 ones
    delta.add_(p, alpha=-lr * weight_decay)
    if compensation is None:
        param.add_(delta)
        return
    delta.add_(compensation.float())
    new = (p + delta).to(param.dtype)
    # what the rounding to param.dtype dropped; new - p is exact in float32 (nearby bf16/fp16 values)
    compensation.copy_(delta.sub_(new.float().sub_(p)))
    param.copy_(new)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW with bfloat16 moments and, for 16-bit parameters, a ``compensation`` buffer; elementwise,
    so it works on FSDP2 shards and with ``torch.distributed.checkpoint``."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"optim.betas={tuple(betas)}: each beta must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("optim.strategy=adamw_bf16 does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    if param.dtype in _LOW_PRECISION:
                        state["compensation"] = torch.zeros_like(param)
                state["step"] = state["step"] + 1  # not in place: a loaded state dict may share it
                compensation = state.get("compensation")
                adamw_bf16_update(
                    _local(param), _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    None if compensation is None else _local(compensation),
                    step=int(state["step"].item()), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating state tensor to its parameter's dtype when loading (float32
        # moments for float32 parameters); put the moments back in bfloat16 (lossless: they were
        # saved as bfloat16)
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "adamw_bf16": AdamWBF16}


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """``optim.strategy``'s optimizer over the trainable ``params`` (eps 1e-8 as in EasyR1)."""
    if optim.strategy not in OPTIMIZERS:
        raise ValueError(f"unknown optim.strategy {optim.strategy!r}; valid: {sorted(OPTIMIZERS)}")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (everything frozen?); nothing to optimise")
    return OPTIMIZERS[optim.strategy](
        params, lr=float(optim.lr), betas=tuple(optim.betas), weight_decay=float(optim.weight_decay)
    )


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
    """Factor on the peak learning rate at 0-based ``step``: warm-up (step < W): (step + 1) / W (not
    transformers' s / W: the first update is not wasted); constant: 1; cosine: r + (1 - r) * (1 +
    cos(pi * p)) / 2, p = (step - W) / (total_steps - W) clipped to [0, 1], r = min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler_type == "constant":
        return 1.0
    if scheduler_type == "cosine":
        floor = 0.0 if min_lr_ratio is None else float(min_lr_ratio)
        progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown optim.lr_scheduler_type {scheduler_type!r}; valid: 'constant', 'cosine'")


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose factor is :func:`lr_multiplier` (step 0 = the first update)."""
    fn = partial(
        lr_multiplier,
        total_steps=total_steps,
        warmup_steps=warmup_steps_for(total_steps, optim.lr_warmup_ratio, optim.lr_warmup_steps),
        scheduler_type=optim.lr_scheduler_type,
        min_lr_ratio=optim.min_lr_ratio,
    )
    fn(0)  # fail now, not at the first step, on a bad scheduler type
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule by one training step, also after a skipped optimizer step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
