"""The advantage stage leaves episodes whose environment failed out of their group's statistics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from easyvlm.algorithms.advantages import own_groups
from easyvlm.data.batch import Batch
from easyvlm.trainer.stages import STAGES, StageContext, StepState

# one prompt's group of 4 episodes: rewards 1, 0, (failed), 1; the failed one trains no token
MASK = torch.tensor([[True, True], [True, False], [False, False], [True, True]])
TOKEN_REWARDS = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
FINISH = ["done", "done", "error", "done"]


def advantages_of(finish: list[str]) -> torch.Tensor:
    spec = SimpleNamespace(estimator="grpo", multi_objective_aggregation="sum_then_normalize", gamma=1.0, lam=1.0,
                           norm_by_std=True)
    batch = Batch({"response_mask": MASK, "group_ids": torch.tensor([5, 5, 5, 5])},
                  {"trajectory": [{"finish": f} for f in finish]})
    state = StepState(step=1, prompts=Batch({}), batch=batch, reward=None, metrics={}, token_rewards=TOKEN_REWARDS)
    STAGES["advantages"](StageContext(advantage=spec))(state)
    return state.batch["advantages"]


def test_a_failed_episode_is_out_of_its_groups_mean_and_std():
    # the group is the 3 others: rewards 1, 0, 1; mean 2/3, std (Bessel) sqrt(((1/3)^2 * 2 + (2/3)^2) / 2)
    # = sqrt(1/3); A = (1/3) / sqrt(1/3) = sqrt(1/3) = 0.5774 and -(2/3) / sqrt(1/3) = -1.1547
    a, b = 3 ** -0.5, -2 * 3 ** -0.5
    expected = torch.tensor([[a, a], [b, 0.0], [0.0, 0.0], [a, a]])
    torch.testing.assert_close(advantages_of(FINISH), expected, rtol=0, atol=1e-5)  # eps 1e-6 in the std


def test_an_episode_that_ended_otherwise_stays_in_its_group():
    # the same rewards with all 4 in the group (reward 0 for the third): mean 1/2, std sqrt(1/3);
    # A = +-(1/2) / sqrt(1/3) = +-0.8660 (the third's tokens are masked, so 0 there)
    c = 0.5 * 3 ** 0.5
    expected = torch.tensor([[c, c], [-c, 0.0], [0.0, 0.0], [c, c]])
    torch.testing.assert_close(advantages_of(["done", "done", "max_turns", "done"]), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("alone", [[False, True, False, False], [True, False, False, True]])
def test_own_groups_gives_each_lone_sample_an_id_no_other_sample_has(alone):
    ids = torch.tensor([7, 7, 9, 9])
    out = own_groups(ids, torch.tensor(alone))
    lone = torch.tensor(alone)
    assert torch.equal(out[~lone], ids[~lone])  # the others keep theirs
    for i in torch.nonzero(lone).flatten().tolist():
        assert (out == out[i]).sum() == 1  # its own group
    assert own_groups(ids, torch.zeros(4, dtype=torch.bool)) is ids
