"""The config validator's name lists (easyvlm/config/schema.py, torch-free) agree with the registries."""

import typing

import torch

from easyvlm.algorithms import (
    LOSS_AVG_MODES,
    AdvantageInputs,
    advantage_names,
    get_advantage,
    kl_names,
    policy_loss_names,
)
from easyvlm.config import names


def test_names_agree_with_the_config_schema():
    assert set(names.ADV_ESTIMATORS) == set(advantage_names())
    assert set(names.POLICY_LOSSES) == set(policy_loss_names())
    assert set(typing.get_args(names.KLPenalty)) == set(kl_names())
    assert set(typing.get_args(names.LossAvgMode)) == set(LOSS_AVG_MODES)


def test_group_estimators_are_the_ones_that_need_a_group():
    # the config treats these as needing rollout.n >= 2; each gives the lone sample (reward 3, far
    # from the others) advantage 0. (reinforce_plus_plus_baseline centres it to 0 and then whitens
    # over the batch; here the centred values 0, -0.5, 0.5 have mean 0, so it stays 0.)
    mask = torch.ones(3, 1, dtype=torch.bool)
    inputs = AdvantageInputs(
        token_rewards=torch.tensor([[3.0], [0.0], [1.0]]),
        response_mask=mask,
        group_ids=torch.tensor([7, 1, 1]),
        values=torch.zeros(3, 1),
        baseline_rewards=torch.zeros(3),
        turn_index=torch.zeros(3, 1, dtype=torch.long),  # gigpo: one step each, from the same state
        step_rewards=torch.tensor([[3.0], [0.0], [1.0]]),
        step_anchors=torch.zeros(3, 1, dtype=torch.long),
    )
    lone_is_zero = {name for name in advantage_names() if get_advantage(name)(inputs).advantages[0, 0] == 0}
    assert lone_is_zero == set(names.GROUP_ADV_ESTIMATORS)
