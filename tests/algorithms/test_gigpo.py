"""GiGPO (algorithm.adv_estimator=gigpo): the episode and step advantages of a hand-made batch, worked
out in the comments; step groups of one, observation tokens, omega = 0 (= grpo) and the step-group
metrics."""

from __future__ import annotations

import pytest
import torch

from easyvlm.algorithms import AdvantageInputs, get_advantage
from easyvlm.algorithms.advantages import weighted_gigpo_advantages
from easyvlm.algorithms.step_groups import on_step_tokens, step_group_metrics, step_returns, steps_taken

EPS = 1e-6
A, B, C, D = 10, 20, 30, 40  # anchor states
# Prompt group 0: three episodes. Each step is 2 model tokens, an observation token follows every
# step but the last; T = 8, S = 3 step columns.
#   episode 0: steps from A, B, C; rewards 0.5, 0, 1  -> return 1.5
#   episode 1: steps from A, B;    rewards 0.5, 0     -> return 0.5
#   episode 2: steps from A, D, C; rewards 0,   0, 1  -> return 1
# Prompt group 1 starts from the same anchor A (another prompt: its own step group):
#   episode 3: one step from A, reward 2 -> return 2;  episode 4: one step from A, reward 0 -> 0
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1])
TURN_INDEX = torch.tensor([
    [0, 0, -1, 1, 1, -1, 2, 2],
    [0, 0, -1, 1, 1, -1, -1, -1],
    [0, 0, -1, 1, 1, -1, 2, 2],
    [0, 0, -1, -1, -1, -1, -1, -1],
    [0, 0, -1, -1, -1, -1, -1, -1],
])
STEP_REWARDS = torch.tensor([[0.5, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
STEP_ANCHORS = torch.tensor([[A, B, C], [A, B, 0], [A, D, C], [A, 0, 0], [A, 0, 0]])
RETURNS = [1.5, 0.5, 1.0, 2.0, 0.0]


def inputs(norm_by_std: bool, gamma: float = 0.5) -> AdvantageInputs:
    mask = TURN_INDEX >= 0
    last = torch.where(mask, torch.arange(8), -1).max(dim=1).values
    token_rewards = torch.zeros(5, 8)
    token_rewards[torch.arange(5), last] = torch.tensor(RETURNS)  # the sequence reward on the last model token
    return AdvantageInputs(token_rewards=token_rewards, response_mask=mask, group_ids=GROUP_IDS, gamma=gamma,
                           norm_by_std=norm_by_std, turn_index=TURN_INDEX, step_rewards=STEP_REWARDS,
                           step_anchors=STEP_ANCHORS)


def per_step(advantages: torch.Tensor) -> list[list[float]]:
    """Each episode's advantage on each of its steps' tokens (both tokens of a step agree)."""
    out = []
    for row, index in zip(advantages, TURN_INDEX):
        steps = []
        for k in range(int(index.max()) + 1):
            values = row[index == k]
            assert torch.equal(values, values[:1].expand_as(values)), "one advantage per step"
            steps.append(float(values[0]))
        out.append(steps)
    return out


def test_discounted_returns_per_step():
    # gamma 0.5: G_k = r_k + 0.5 G_{k+1}. Episode 0: G2 = 1, G1 = 0 + 0.5 = 0.5, G0 = 0.5 + 0.25 = 0.75;
    # episode 1: G1 = 0, G0 = 0.5; episode 2: G2 = 1, G1 = 0.5, G0 = 0.25; episodes 3, 4: 2, 0
    expected = [[0.75, 0.5, 1.0], [0.5, 0.0, 0.0], [0.25, 0.5, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert step_returns(STEP_REWARDS, 0.5).tolist() == expected
    assert steps_taken(TURN_INDEX, 3).tolist() == [[True] * 3, [True, True, False], [True] * 3,
                                                   [True, False, False], [True, False, False]]


def test_hand_values_without_std():
    # episode (Dr. GRPO): group 0 returns 1.5, 0.5, 1 (mean 1): +0.5, -0.5, 0; group 1: 2, 0 (mean 1): +1, -1
    # step groups, returns G from above minus their mean:
    #   group 0, A: 0.75, 0.5, 0.25 (mean 0.5) -> +0.25, 0, -0.25;  B: 0.5, 0 (mean 0.25) -> +0.25, -0.25
    #   group 0, C: 1, 1 -> 0, 0;  D: episode 2's step 1 alone -> 0
    #   group 1, A: 2, 0 (mean 1) -> +1, -1 (not pooled with group 0's A, whose mean would be 0.7)
    # A = episode + step:
    #   0: 0.5 + 0.25, 0.5 + 0.25, 0.5 + 0 | 1: -0.5 + 0, -0.5 - 0.25 | 2: 0 - 0.25, 0 + 0, 0 + 0 | 3: 2 | 4: -2
    out = get_advantage("gigpo")(inputs(norm_by_std=False))
    assert per_step(out.advantages) == [[0.75, 0.75, 0.5], [-0.5, -0.75], [-0.25, 0.0, 0.0], [2.0], [-2.0]]
    assert torch.equal(out.returns, out.advantages)


def test_hand_values_with_std():
    # episode: group 0 deviations 0.5, -0.5, 0, unbiased std sqrt((0.25 + 0.25) / 2) = 0.5;
    #   group 1: 1, -1, std sqrt(2)
    # steps: A (group 0) deviations 0.25, 0, -0.25, std sqrt(0.125 / 2) = 0.25; B: 0.25, -0.25, std
    #   sqrt(0.125) = 0.353553; C: std 0 -> 0 / eps = 0; D alone -> 0; A (group 1): 1, -1, std sqrt(2)
    e0, eb, e1 = 0.5 / (0.5 + EPS), 0.25 / (0.125 ** 0.5 + EPS), 1 / (2 ** 0.5 + EPS)
    s_a = 0.25 / (0.25 + EPS)
    expected = [[e0 + s_a, e0 + eb, e0], [-e0, -e0 - eb], [-s_a, 0.0, 0.0], [2 * e1], [-2 * e1]]
    got = per_step(get_advantage("gigpo")(inputs(norm_by_std=True)).advantages)
    for got_row, want_row in zip(got, expected):
        assert got_row == pytest.approx(want_row, abs=1e-6)  # float32 of values below 3


def test_a_step_group_of_one_and_observation_tokens_get_no_step_advantage():
    x = inputs(norm_by_std=True)
    with_steps = get_advantage("gigpo")(x).advantages
    episode_only = weighted_gigpo_advantages(x, step_weight=0.0).advantages
    # episode 2's step 1 (from D, which no other episode visits) keeps its episode advantage, 0
    assert torch.equal(with_steps[2][TURN_INDEX[2] == 1], episode_only[2][TURN_INDEX[2] == 1])
    assert (with_steps[2][TURN_INDEX[2] == 1] == 0).all()
    # observation and padding tokens: 0; the model's: all but episode 2's steps 1 (D) and 2 (C, equal
    # returns; episode advantage 0), 8 steps of 2 tokens
    assert (with_steps[TURN_INDEX < 0] == 0).all() and (with_steps[TURN_INDEX >= 0] != 0).sum() == 16
    # a step's value lands on its own tokens only, whatever the response mask says
    assert torch.equal(on_step_tokens(torch.tensor([[1.0, 2.0, 3.0]] * 5), TURN_INDEX),
                       torch.where(TURN_INDEX >= 0, TURN_INDEX + 1.0, 0.0))


@pytest.mark.parametrize("norm_by_std", [False, True])
def test_omega_zero_is_grpo(norm_by_std):
    x = inputs(norm_by_std)
    assert torch.equal(weighted_gigpo_advantages(x, 0.0).advantages, get_advantage("grpo")(x).advantages)


def test_omega_weighs_the_step_part():
    # omega = 2: episode 0's step 0 is 0.5 + 2 x 0.25 = 1 (Dr. GRPO values of test_hand_values_without_std)
    assert per_step(weighted_gigpo_advantages(inputs(False), 2.0).advantages)[0] == [1.0, 1.0, 0.5]


def test_step_group_metrics():
    # step groups: group 0 A (3 steps), B (2), C (2), D (1); group 1 A (2): sizes mean 10 / 5 = 2, max 3;
    # 9 of the 10 steps are in a group of two or more
    assert step_group_metrics(GROUP_IDS, STEP_ANCHORS, TURN_INDEX) == {
        "gigpo/step_group_size_mean": 2.0, "gigpo/step_group_size_max": 3.0, "gigpo/grouped_step_fraction": 0.9,
    }


def test_gigpo_without_step_inputs_says_what_is_missing():
    x = inputs(False)
    plain = AdvantageInputs(token_rewards=x.token_rewards, response_mask=x.response_mask, group_ids=x.group_ids)
    with pytest.raises(ValueError, match="gigpo.*worker.rollout.environment"):
        get_advantage("gigpo")(plain)
    with pytest.raises(ValueError, match="come together"):
        AdvantageInputs(token_rewards=x.token_rewards, response_mask=x.response_mask, group_ids=x.group_ids,
                        turn_index=TURN_INDEX)
    with pytest.raises(ValueError, match="names step 2, but there are 2 step columns"):
        AdvantageInputs(token_rewards=x.token_rewards, response_mask=x.response_mask, group_ids=x.group_ids,
                        turn_index=TURN_INDEX, step_rewards=STEP_REWARDS[:, :2], step_anchors=STEP_ANCHORS[:, :2])
