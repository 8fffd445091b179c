"""Adaptive entropy control in the driver loop (worker.actor.use_adaptive_entropy): the trainer's
controller hands each actor update its coefficient, steps on the update's measured entropy, logs
actor/entropy_coeff and travels with the trainer checkpoint. Fakes as in test_loop.py."""

from __future__ import annotations

import pytest
import torch
from test_loop import make_trainer

ADAPTIVE = ("worker.actor.use_adaptive_entropy=true", "worker.actor.entropy_coeff=0.05", "worker.actor.entropy_target=0.3",
            "worker.actor.entropy_coeff_delta=0.01", "worker.actor.entropy_coeff_min=0.04", "worker.actor.entropy_coeff_max=0.06")


def measured(fakes, entropies: list[float]) -> list[dict]:
    """The fake actor update reports ``entropies`` in turn as actor/entropy; returns its calls' kwargs."""
    calls, answers, answer = [], iter(entropies), fakes.hybrid.dispatch_collect

    def dispatch_collect(method, batch, replicas=1, **kwargs):
        out = answer(method, batch, replicas, **kwargs)
        if method == "update_actor":
            calls.append(kwargs)
            return [{**out[0], "actor/entropy": next(answers)}]
        return out

    fakes.hybrid.dispatch_collect = dispatch_collect
    return calls


def steps(trainer, count: int) -> list[dict[str, float]]:
    prompts = iter(trainer.train_loader)
    out = []
    for step in range(1, count + 1):
        trainer.global_step = step
        out.append(trainer.train_step(next(prompts)))
    return out


def test_the_loop_steps_the_coefficient_on_each_updates_entropy(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, *ADAPTIVE, "trainer.max_steps=4")
    calls = measured(fakes, [0.1, 0.2, 0.5, 0.25])
    metrics = steps(trainer, 4)
    # c0 = entropy_coeff 0.05, target 0.3, delta 0.01, c in [0.04, 0.06]; step k applies c if the
    # entropy measured at step k-1 <= 0.3, else 0 (step 1: none measured yet, so 0, as TRL)
    #   step  applied   measured H   c after
    #   1     0         0.1          min(0.05 + 0.01, 0.06) = 0.06
    #   2     0.06      0.2          min(0.07, 0.06) = 0.06        (clamped at entropy_coeff_max)
    #   3     0.06      0.5          0.06 - 0.01 = 0.05
    #   4     0         0.25         0.05 + 0.01 = 0.06             (gated off by step 3's 0.5)
    applied = [0.0, 0.06, 0.06, 0.0]
    assert [kw["entropy_coeff"] for kw in calls] == pytest.approx(applied, abs=1e-12)
    assert [m["actor/entropy_coeff"] for m in metrics] == pytest.approx(applied, abs=1e-12)
    assert trainer.entropy_ctrl.value == pytest.approx(0.06) and trainer.entropy_ctrl.last_entropy == 0.25
    # one more measurement above the target: 0.05, then the floor entropy_coeff_min = 0.04 holds
    trainer.entropy_ctrl.update(0.9)
    trainer.entropy_ctrl.update(0.9)
    assert trainer.entropy_ctrl.value == pytest.approx(0.04) and trainer.entropy_ctrl.bonus_coeff == 0.0


def test_the_controller_travels_with_the_trainer_checkpoint(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, *ADAPTIVE)
    measured(fakes, [0.1, 0.5])
    steps(trainer, 2)  # c: 0.05 -> 0.06 -> 0.05, last entropy 0.5
    path = trainer.save_checkpoint(None)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert state["entropy_ctrl"] == {"value": pytest.approx(0.05), "last_entropy": 0.5}
    resumed, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path / "resumed", *ADAPTIVE)
    resumed.resume_from = path
    resumed.train_loader.load_state_dict = lambda state: None  # the fake loader has nothing to restore
    resumed._load_checkpoint()
    assert resumed.entropy_ctrl.state_dict() == trainer.entropy_ctrl.state_dict()
    calls = measured(fakes, [0.2])
    steps(resumed, 1)
    assert calls == [{"entropy_coeff": 0.0}]  # gated off by the saved 0.5 > target 0.3, not a fresh start
    assert resumed.entropy_ctrl.value == pytest.approx(0.06)


def test_without_adaptive_entropy_the_update_gets_no_coefficient(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "worker.actor.entropy_coeff=0.05")
    metrics = steps(trainer, 1)[0]
    assert trainer.entropy_ctrl is None and "actor/entropy_coeff" not in metrics
    assert [kw for method, _, kw in fakes.hybrid.calls if method == "update_actor"] == [{}]  # the actor keeps its spec's
    path = trainer.save_checkpoint(None)
    assert "entropy_ctrl" not in torch.load(path / "trainer_state.pt", weights_only=True)
