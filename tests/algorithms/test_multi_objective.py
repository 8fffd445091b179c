"""GDPO's normalize_then_sum (easyvlm/algorithms/multi_objective.py): hand-derived values."""

import math

import pytest
import torch
from torch.testing import assert_close

from easyvlm.algorithms import AdvantageInputs, get_advantage
from easyvlm.algorithms.multi_objective import (
    MULTI_OBJECTIVE_EPS,
    batch_normalize,
    gdpo_advantages,
    gdpo_scores,
    normalize_then_sum,
    score_as_advantage,
)

E = MULTI_OBJECTIVE_EPS  # 1e-4, TRL's
# 2 groups x 2 samples x 2 functions, weights (1, 0.5)
GROUP_IDS = torch.tensor([0, 0, 1, 1])
SCORES = torch.tensor([[1.0, 0.2], [0.0, 0.6], [1.0, 0.0], [1.0, 1.0]])  # column k: function k's overall
WEIGHTS = (1.0, 0.5)
# function 1, group 0 {1, 0}: mean 0.5, unbiased std sqrt(0.25 + 0.25) = sqrt(0.5) -> rhat = +-0.5 / (sqrt(0.5) + E)
#             group 1 {1, 1}: std 0 -> rhat = 0 / E = 0
# function 2, group 0 {0.2, 0.6}: mean 0.4, std sqrt(0.04 + 0.04) = sqrt(0.08) -> rhat = -+0.2 / (sqrt(0.08) + E)
#             group 1 {0, 1}: mean 0.5, std sqrt(0.5) -> rhat = -+0.5 / (sqrt(0.5) + E)
A1 = 0.5 / (math.sqrt(0.5) + E)  # 0.707007
B2 = 0.2 / (math.sqrt(0.08) + E)  # 0.706857 (not A1: eps weighs differently on a smaller std)
# R = rhat_1 + 0.5 rhat_2: 0.353578, -0.353578, -0.353503, 0.353503
R = torch.tensor([A1 - 0.5 * B2, -A1 + 0.5 * B2, -0.5 * A1, 0.5 * A1])
# batch: mean 0 (each group's rhat sum to 0), unbiased std sqrt(2 (R0^2 + R2^2) / 3) = 0.408234
STD_R = math.sqrt(2 * (R[0].item() ** 2 + R[2].item() ** 2) / 3)
A = R / (STD_R + E)  # 0.865905, -0.865905, -0.865722, 0.865722


def test_normalize_then_sum_hand_values():
    assert_close(normalize_then_sum(SCORES, WEIGHTS, GROUP_IDS), R)


def test_gdpo_scores_hand_values_and_batch_normalisation():
    assert_close(gdpo_scores(SCORES, WEIGHTS, GROUP_IDS), A)
    # the batch normalisation alone: mean 2, unbiased std 1 -> -1, 0, 1 over (1 + E)
    assert_close(batch_normalize(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([-1.0, 0.0, 1.0]) / (1 + E))


def test_gdpo_advantages_on_every_valid_token():
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [False, False, False]])
    out = gdpo_advantages(SCORES, WEIGHTS, GROUP_IDS, mask)
    expected = torch.where(mask, A.unsqueeze(-1), 0.0)
    assert_close(out.advantages, expected)
    assert_close(out.returns, expected)
    with pytest.raises(ValueError, match="bool"):
        gdpo_advantages(SCORES, WEIGHTS, GROUP_IDS, mask.float())


def test_weights_scale_each_normalised_function():
    # weights (0, 2): only function 2 counts, R = 2 rhat_2 = -2 B2, 2 B2, -2 A1, 2 A1
    assert_close(normalize_then_sum(SCORES, (0.0, 2.0), GROUP_IDS), torch.tensor([-2 * B2, 2 * B2, -2 * A1, 2 * A1]))


def test_groups_in_any_order_and_size():
    # the same samples shuffled: each keeps its value
    order = torch.tensor([3, 0, 2, 1])
    assert_close(normalize_then_sum(SCORES[order], WEIGHTS, GROUP_IDS[order]), R[order])
    # a group of one: its mean is itself, std 0 -> rhat 0 for every function
    scores = torch.tensor([[1.0, 0.2], [0.0, 0.6], [5.0, 9.0]])
    assert_close(normalize_then_sum(scores, WEIGHTS, torch.tensor([0, 0, 7]))[2], torch.tensor(0.0))
    # a batch of one: 0, not NaN
    assert_close(gdpo_scores(scores[:1], WEIGHTS, torch.tensor([0])), torch.tensor([0.0]))


def test_decoupling_keeps_combinations_apart_that_the_sum_collapses():
    # GDPO's example (fig. 2): two binary rewards, two samples per prompt. Prompt 0's samples score
    # (0, 0) and (0, 1): sums 0, 1; prompt 1's score (0, 0) and (1, 1): sums 0, 2. Summed first and
    # normalised per group (GRPO): {0, 1} -> -+0.5 / sqrt(0.5), {0, 2} -> -+1 / sqrt(2): both -+0.707107.
    scores = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    ids = torch.tensor([0, 0, 1, 1])
    sums = scores.sum(-1, keepdim=True)
    grpo = get_advantage("grpo")(AdvantageInputs(token_rewards=sums, response_mask=torch.ones(4, 1, dtype=torch.bool),
                                                 group_ids=ids)).advantages[:, 0]
    assert_close(grpo[:2], grpo[2:])  # (0, 1) earns what (1, 1) earns: collapsed
    # normalised first: prompt 0 -> function 2 only: -+0.5 / (sqrt(0.5) + E) = -+c;
    # prompt 1 -> both functions: -+2c. R = -c, c, -2c, 2c: three distinct magnitudes kept apart
    c = 0.5 / (math.sqrt(0.5) + E)
    assert_close(normalize_then_sum(scores, (1.0, 1.0), ids), torch.tensor([-c, c, -2 * c, 2 * c]))


def test_score_as_advantage_puts_the_sequence_score_on_its_tokens():
    # rewards summed over valid tokens: 0.5 + 0.25 = 0.75; -1 (the padding's 9 is not counted)
    mask = torch.tensor([[True, True], [True, False]])
    out = score_as_advantage(AdvantageInputs(token_rewards=torch.tensor([[0.5, 0.25], [-1.0, 9.0]]), response_mask=mask,
                                             group_ids=torch.tensor([0, 0])))
    assert_close(out.advantages, torch.tensor([[0.75, 0.75], [-1.0, 0.0]]))
    assert_close(out.returns, out.advantages)


def test_shape_problems_are_named():
    with pytest.raises(ValueError, match=r"scores must be \(B, K\)"):
        normalize_then_sum(SCORES, (1.0,), GROUP_IDS)
