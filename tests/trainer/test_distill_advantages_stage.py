"""The ``distill_advantages`` batch stage (on-policy distillation's advantages in the driver), on hand
values: the teacher's log-prob advantage added to the estimator's, or alone (pure distillation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from easyvlm.algorithms.settings import DistillSettings
from easyvlm.data.batch import Batch
from easyvlm.trainer.stages import STAGES, StageContext, StepState

MASK = torch.tensor([[True, True, False], [True, False, False]])
TEACHER = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, 0.0, 0.0]])  # padding may hold anything
OLD = torch.tensor([[-1.5, -1.0, 7.0], [-0.5, 0.0, 0.0]])
ESTIMATED = torch.tensor([[0.3, 0.3, 0.0], [-0.7, 0.0, 0.0]])  # the estimator's (GRPO: one value per sequence)
TOKEN_REWARDS = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def run_stage(**settings) -> StepState:
    trainer = StageContext(advantage=SimpleNamespace(distill=DistillSettings(**settings)))
    batch = Batch({"response_mask": MASK, "teacher_logprobs": TEACHER, "old_logprobs": OLD})
    if not settings.get("distill_only"):
        batch["advantages"] = ESTIMATED.clone()
    state = StepState(step=1, prompts=Batch({}), batch=batch, reward=None, metrics={}, token_rewards=TOKEN_REWARDS)
    STAGES["distill_advantages"](trainer)(state)
    return state


def test_the_teachers_advantage_is_added_to_the_estimators():
    state = run_stage(distill_coef=0.5, distill_as_reward=True)
    # 0.5 * (teacher - old) at valid tokens: row 0: 0.5 * (-1 + 1.5) = 0.25, 0.5 * (-2 + 1) = -0.5;
    # row 1: 0.5 * (-0.5 + 0.5) = 0; plus the estimator's
    expected = torch.tensor([[0.3 + 0.25, 0.3 - 0.5, 0.0], [-0.7, 0.0, 0.0]])
    torch.testing.assert_close(state.batch["advantages"], expected, rtol=0, atol=1e-7)
    # token means over the 3 valid tokens: KL estimate (old - teacher) = (-0.5 + 1.0 + 0) / 3 = 1/6;
    # teacher log-prob = (-1 - 2 - 0.5) / 3 = -7/6
    assert state.metrics["distill/reverse_kl"] == pytest.approx(1 / 6)
    assert state.metrics["distill/teacher_logprob"] == pytest.approx(-7 / 6)
    assert state.metrics["timing_s/adv"] >= 0.0  # timed with the other advantage math


def test_pure_distillation_as_reward_is_the_teachers_advantage_alone():
    state = run_stage(distill_coef=2.0, distill_as_reward=True, distill_only=True)
    expected = torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])  # 2 * (teacher - old), 0 at padding
    torch.testing.assert_close(state.batch["advantages"], expected, rtol=0, atol=0)
    torch.testing.assert_close(state.batch["returns"], expected, rtol=0, atol=0)
    assert torch.equal(state.batch["token_rewards"], TOKEN_REWARDS)  # the rewards still logged (critic/rewards)


def test_pure_distillation_as_a_loss_has_no_advantage():
    state = run_stage(distill_coef=1.0, distill_only=True)
    assert torch.equal(state.batch["advantages"], torch.zeros(2, 3))
    assert "distill/reverse_kl" not in state.metrics  # the update measures it (the loss term's own)
