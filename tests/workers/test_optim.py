"""The learning-rate schedule (by hand) and the optimizer's parameter selection."""

from __future__ import annotations

import math

import pytest
import torch

from easyvlm.config.schema import OptimConfig
from easyvlm.workers.optim import build_optimizer, build_scheduler, lr_multiplier, warmup_steps_for


def test_warmup_steps():
    assert warmup_steps_for(100, lr_warmup_ratio=0.05) == 5
    assert warmup_steps_for(100, lr_warmup_ratio=0.05, lr_warmup_steps=3) == 3  # explicit steps win
    assert warmup_steps_for(100) == 0


def test_constant_with_warmup_by_hand():
    # W = 4: steps 0..3 get 1/4, 2/4, 3/4, 4/4; then 1 for good
    got = [lr_multiplier(s, total_steps=10, warmup_steps=4) for s in range(6)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_by_hand():
    # W = 2, total 6, floor r = 0.2: after warm-up p = (s - 2) / 4 for s = 2..6
    # factor = 0.2 + 0.8 * (1 + cos(pi p)) / 2: p=0 -> 1, p=1/4 -> 0.2 + 0.4 (1 + 0.70711) = 0.88284,
    # p=1/2 -> 0.6, p=3/4 -> 0.2 + 0.4 (1 - 0.70711) = 0.31716, p=1 -> 0.2; after the end it stays 0.2
    kw = dict(total_steps=6, warmup_steps=2, scheduler_type="cosine", min_lr_ratio=0.2)
    got = [lr_multiplier(s, **kw) for s in range(8)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.882843, 0.6, 0.317157, 0.2, 0.2], abs=1e-6)
    # no floor given: decays to 0
    assert lr_multiplier(6, total_steps=6, warmup_steps=0, scheduler_type="cosine") == pytest.approx(0.0, abs=1e-12)


def test_unknown_scheduler_type_is_refused_at_build_time():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="lr_scheduler_type 'linear'"):
        build_scheduler(optimizer, OptimConfig(lr_scheduler_type="linear"), total_steps=10)  # type: ignore[arg-type]


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], OptimConfig(lr=0.1, lr_warmup_ratio=0.5, lr_scheduler_type="cosine"))
    scheduler = build_scheduler(optimizer, OptimConfig(lr=0.1, lr_warmup_ratio=0.5, lr_scheduler_type="cosine"), 4)
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # W = int(0.5 * 4) = 2: 0.05, 0.1; cosine p = 0, 1/2: 0.1, 0.05
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05])
    assert math.isclose(optimizer.param_groups[0]["weight_decay"], 0.01)


def test_only_trainable_parameters_are_optimised():
    frozen, trained = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    frozen.requires_grad_(False)
    optimizer = build_optimizer([frozen, trained], OptimConfig())
    assert optimizer.param_groups[0]["params"] == [trained]
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([frozen], OptimConfig())
