"""The learning-rate schedule (by hand), the optimizer's parameter selection, and AdamWBF16 (bf16
moments, Kahan-compensated low-precision parameters): one step by hand, N steps against
torch.optim.AdamW within a bound derived from bfloat16's 8-bit significand, memory, state dict
round trips, and FSDP2 DTensors over 2 gloo ranks with a torch.distributed.checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch
from fsdp_testing import optimizer_main, spawn

from easyvlm.workers.settings import OptimConfig
from easyvlm.workers.optim import (
    OPTIMIZERS,
    AdamWBF16,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    warmup_steps_for,
)

# bfloat16 keeps 8 significant bits: rounding to nearest changes a value by at most 2**-8 of it
BF16_ROUNDOFF = 2.0**-8


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


# ------------------------------------------------------------------------------------ strategies
@pytest.mark.parametrize("strategy", sorted(OPTIMIZERS))
def test_every_strategy_gets_the_hyperparameters(strategy):
    param = torch.nn.Parameter(torch.zeros(3))
    optim = OptimConfig(strategy=strategy, lr=0.5, betas=(0.8, 0.9), weight_decay=0.25)
    optimizer = build_optimizer([param], optim)
    assert type(optimizer) is OPTIMIZERS[strategy]
    group = optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"], group["eps"]) == (0.5, (0.8, 0.9), 0.25, 1e-8)
    assert type(build_optimizer([param], OptimConfig(strategy="adamw_bf16"))) is AdamWBF16


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match=r"unknown optim.strategy 'sgd'; valid: \['adamw', 'adamw_bf16'\]"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(strategy="sgd"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- AdamWBF16
def test_one_step_by_hand():
    # lr 0.1, weight decay 0.5: decay factor 1 - 0.1 * 0.5 = 0.95; betas (0.9, 0.999), eps 1e-8.
    # Step 1: m = 0.1 g, v = 0.001 g^2; bias-corrected m_hat = m / 0.1 = g, v_hat = v / 0.001 = g^2,
    # so the step is lr * g / (|g| + eps) = 0.1 * sign(g) (eps shifts it by 1e-9 relative); g = 0
    # gives m = v = 0 and a step of 0 / eps = 0, leaving the weight decay alone:
    #   p = 1.0,  g =  0.5: 0.95 * 1.0  - 0.1 =  0.85
    #   p = -2.0, g = -4.0: 0.95 * -2.0 + 0.1 = -1.8
    #   p = 0.5,  g =  0.0: 0.95 * 0.5        =  0.475
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optimizer = AdamWBF16([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.tensor([0.5, -4.0, 0.0])
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.tensor([0.85, -1.8, 0.475]))
    state = optimizer.state[param]
    assert state["step"].item() == 1.0
    # stored rounded to bfloat16: 0.1 g = [0.05, -0.4, 0], 0.001 g^2 = [0.00025, 0.016, 0]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], torch.tensor([0.05, -0.4, 0.0]).bfloat16())
    assert torch.equal(state["exp_avg_sq"], torch.tensor([0.00025, 0.016, 0.0]).bfloat16())
    assert "compensation" not in state  # float32 parameters need none
    # and the same as torch's AdamW
    reference = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    torch_adamw = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.5)
    reference.grad = torch.tensor([0.5, -4.0, 0.0])
    torch_adamw.step()
    torch.testing.assert_close(param.detach(), reference.detach())


def test_steps_track_torch_adamw_within_the_bfloat16_bound():
    # Same gradients into both optimizers (they do not depend on the weights, so only the
    # optimizers differ). Per element the gradients keep one sign, magnitudes in [0.5, 1.5].
    # Bound: let rho = 2**-8. Each stored moment is the exact float32 value times (1 + d), |d| <= rho.
    # With same-sign terms, x_t = b m~_{t-1} + (1 - b) g_t is a weighted mean of (m~_{t-1} / m_{t-1})
    # and 1 times m_t, so by induction x_t / m_t lies in [(1 - rho)^(t-1), (1 + rho)^(t-1)]; the
    # same holds for v (its terms g^2 are all >= 0). The step uses x_m / sqrt(x_v) (eps only pulls
    # the ratio towards 1), so |u_t / u_t_ref - 1| <= (1 + rho)^(t-1) / (1 - rho)^((t-1)/2) - 1 =: e_t.
    # Weight decay multiplies the difference by 1 - lr wd < 1 each step, so after N steps
    #   |p_N - p_N_ref| <= sum_t lr |u_t_ref| e_t  (+ float32 rounding of the weights: 1e-6 |p|).
    # For N = 20, lr = 1e-2 this is ~1.2 lr |u|: loose (rounding errors mostly cancel) but
    # rigorous; a wrong bias correction or a double-counted decay misses it by ~lr |u| per step.
    steps, lr, wd, rho = 20, 1e-2, 0.1, BF16_ROUNDOFF
    gen = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (512,), generator=gen) * 2.0 - 1.0
    ours = torch.nn.Parameter(torch.randn(512, generator=gen))
    ref = torch.nn.Parameter(ours.detach().clone())
    optimizer, torch_adamw = AdamWBF16([ours], lr=lr, weight_decay=wd), torch.optim.AdamW([ref], lr=lr, weight_decay=wd)
    bound = torch.zeros(512)
    for t in range(1, steps + 1):
        grad = sign * (0.5 + torch.rand(512, generator=gen))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        before = ref.detach().clone()
        optimizer.step()
        torch_adamw.step()
        step_ref = ref.detach() - before * (1 - lr * wd)  # -lr u_t_ref
        e_t = (1 + rho) ** (t - 1) / (1 - rho) ** ((t - 1) / 2) - 1
        bound += step_ref.abs() * e_t
    error = (ours.detach() - ref.detach()).abs()
    assert torch.all(error <= bound + 1e-6 * ref.detach().abs()), (error - bound).max()
    assert error.max() > 0  # bfloat16 moments do change the result


def test_state_memory_is_half_of_adamw():
    # float32 parameters: AdamW keeps 2 x 4 bytes per weight, AdamWBF16 2 x 2 bytes
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]

    def state_bytes(optimizer_cls) -> int:
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        optimizer = optimizer_cls(copies, lr=1e-3)
        for p in copies:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return sum(v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step")

    assert state_bytes(torch.optim.AdamW) == 2 * 4 * 38
    assert state_bytes(AdamWBF16) == 2 * 2 * 38


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kahan_compensation_keeps_updates_smaller_than_the_spacing(dtype):
    # A weight of 1.0 in dtype, 100 steps of about lr = 1e-4 each (constant gradient: u ~ 1).
    # Below 1.0 the spacing is eps/2 (bf16 2**-8, fp16 2**-11), so a plain update of 1e-4, smaller
    # than half of it, rounds back to 1.0 forever; the float32 twin moves by ~0.01.
    # With compensation c: p + c tracks the float32 weight; each step adds the rounding error of
    # storing c (|c| <= eps/4 for weights in [0.5, 1]) in dtype: <= (eps/2) (eps/4) = eps^2/8; so
    # after N steps |p + c - p32| <= N eps^2/8 (+ float32 rounding), and |p - p32| <= that + eps/4.
    steps, lr, eps = 100, 1e-4, torch.finfo(dtype).eps
    low = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    full = torch.nn.Parameter(torch.ones(4))
    opt_low, opt_full = AdamWBF16([low], lr=lr, weight_decay=0.0), AdamWBF16([full], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        low.grad, full.grad = torch.ones(4, dtype=dtype), torch.ones(4)
        opt_low.step()
        opt_full.step()
    compensation = opt_low.state[low]["compensation"]
    assert compensation.dtype == dtype
    assert opt_low.state[low]["exp_avg"].dtype == torch.bfloat16
    assert 1 - full.detach().max() > 0.009  # the float32 twin moved by ~steps * lr
    drift = steps * eps**2 / 8 + steps * 2.0**-23
    assert torch.all((low.detach().float() + compensation.float() - full.detach()).abs() <= drift)
    assert torch.all((low.detach().float() - full.detach()).abs() <= drift + eps / 4)


def test_state_dict_round_trip_keeps_bfloat16_moments():
    # torch.optim.Optimizer.load_state_dict casts floating states to the parameter's dtype (float32
    # here); AdamWBF16 puts the moments back in bfloat16, and the next step is the same
    def make():
        param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        return param, AdamWBF16([param], lr=0.1)

    param, optimizer = make()
    for g in ([0.3, -0.1, 2.0], [0.2, 0.5, -1.0]):
        param.grad = torch.tensor(g)
        optimizer.step()
    copy, restored = make()
    copy.data.copy_(param.detach())
    restored.load_state_dict(optimizer.state_dict())
    state = restored.state[copy]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], optimizer.state[param]["exp_avg"])
    for p, opt in ((param, optimizer), (copy, restored)):
        p.grad = torch.tensor([1.0, 1.0, 1.0])
        opt.step()
    assert torch.equal(copy.detach(), param.detach())


# ---------------------------------------------------------------------------------- two gloo ranks
@pytest.mark.slow
def test_adamw_bf16_on_fsdp2_dtensors_and_dcp_round_trip(tmp_path):
    out = str(tmp_path / "out.pt")
    spawn(optimizer_main, str(tmp_path / "ckpt"), out)
    per_rank = torch.load(out, weights_only=False)
    for rank, result in enumerate(per_rank):
        for stage in ("after_3", "restored", "after_restore_step"):
            for name, got in result[stage].items():
                where = (rank, stage, name)
                # each rank updated its shard; gathered, the weights and moments are the unsharded run's
                assert got["param_equal"] and got["states_equal"], where
                assert got["state_dtypes"] == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}, where
                assert got["states_are_dtensors_like_param"], where
                assert got["step"][0] == got["step"][1], where
        # row counts 6 and 3 over 2 ranks: 3 + 3 and 2 + 1 (uneven shards are updated too)
        assert {n: g["local_rows"] for n, g in result["after_3"].items() if n.endswith("weight")} == (
            {"first.weight": 3, "second.weight": 2} if rank == 0 else {"first.weight": 3, "second.weight": 1}
        )
    assert per_rank[0]["after_3"]["first.weight"]["step"] == (3.0, 3.0)
    assert per_rank[0]["after_restore_step"]["first.weight"]["step"] == (4.0, 4.0)
