"""algorithm.multi_objective_aggregation in the driver's advantage step (easyvlm/trainer/loop.py):
the loop of tests/trainer/test_loop.py (real plan, fake workers and Ray) with two reward functions.

The fake reward actor scores sample j of prompt i with function ``a`` (weight 1) and ``b`` (weight
0.5) from the tables below, and returns each function's own overall under ``a/overall`` and
``b/overall`` (``function_keys``) as the reward manager does with several functions.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_loop import make_trainer, one_step

from easyvlm.rewards.types import RewardResult

REPO_FUNCTIONS = Path(__file__).resolve().parents[2] / "reward_functions"
KEY = "algorithm.multi_objective_aggregation"
# two functions in the config: the plan reads their weights (the fake actor below does the scoring)
TWO = ("worker.reward.reward_function=null",
       f"worker.reward.reward_functions=[{{reward_function: {REPO_FUNCTIONS}/synthetic.py:compute_score, weight: 1}}, "
       f"{{reward_function: {REPO_FUNCTIONS}/math.py:compute_score, weight: 0.5}}]",
       "algorithm.disable_kl=true")
# prompt 0: a = 1 for every sample, b = 1 for sample 0 only; prompt 1: a = 1 for sample 0 only, b = 0
A_SCORES = [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
B_SCORES = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
E = 1e-4  # GDPO's eps (TRL's)


def two_function_scores(inputs) -> RewardResult:
    rows = [(int(x.ground_truth) % 2, x.extra["sample"]) for x in inputs]
    a = [A_SCORES[i][j] for i, j in rows]
    b = [B_SCORES[i][j] for i, j in rows]
    overall = [x + 0.5 * y for x, y in zip(a, b)]
    return RewardResult({"overall": overall, "a/overall": a, "b/overall": b}, {}, [], ["a/overall", "b/overall"])


def step_advantages(monkeypatch, tiny_model_path, tmp_path, *overrides) -> torch.Tensor:
    """The first step's advantages the actor is given, first response token, (8,) = p0's 4 then p1's."""
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, *TWO, *overrides)
    fakes.reward.compute = SimpleNamespace(remote=two_function_scores)
    one_step(trainer)
    update = [b for m, b, _ in fakes.hybrid.calls if m == "update_actor"][0]
    assert torch.equal(update["advantages"][:, 0], update["advantages"][:, -1])  # on every response token
    return update["advantages"][:, 0]


# GDPO, by hand. Prompt 0: a is constant (std 0) -> rhat_a = 0; b = 1, 0, 0, 0: mean 0.25, unbiased std
# sqrt((0.75^2 + 3 x 0.25^2) / 3) = 0.5 -> rhat_b = (0.75, -0.25, -0.25, -0.25) / (0.5 + E) = u.
# Prompt 1: a = 1, 0, 0, 0 -> rhat_a = u; b constant -> 0.  R = 1 rhat_a + 0.5 rhat_b: p0 0.5 u, p1 u.
# Batch: mean 0; unbiased std sqrt((0.25 + 1) x |u|^2 / 7), |u|^2 = 0.75 / (0.5 + E)^2 -> 0.365963 / (0.5 + E).
U = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + E)
R = torch.cat([0.5 * U, U])
STD_R = math.sqrt(1.25 * 0.75 / 7) / (0.5 + E)
GDPO = R / (STD_R + E)  # p0: 1.024578, -0.341526 x 3; p1: 2.049155, -0.683052 x 3


def test_normalize_then_sum_keeps_the_weighted_functions_apart(monkeypatch, tiny_model_path, tmp_path):
    # sum_then_normalize (the default): overall = a + 0.5 b is 1.5, 1, 1, 1 for p0 and 1, 0, 0, 0 for p1;
    # grpo normalises each group: p0 mean 1.125, std 0.25; p1 mean 0.25, std 0.5 -> both 1.5, -0.5 x 3:
    # the group where the weight-1 function differs gets what the weight-0.5 one's group gets
    summed = step_advantages(monkeypatch, tiny_model_path, tmp_path / "sum")
    collapsed = torch.tensor([0.375, -0.125, -0.125, -0.125]) / (0.25 + 1e-6)
    torch.testing.assert_close(summed, torch.cat([collapsed, collapsed]))
    # normalize_then_sum with grpo: GDPO's advantage as it is (TRL's); p1's are twice p0's (the weights)
    gdpo = step_advantages(monkeypatch, tiny_model_path, tmp_path / "gdpo", f"{KEY}=normalize_then_sum")
    torch.testing.assert_close(gdpo, GDPO)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline"])
def test_normalize_then_sum_is_the_score_of_other_outcome_estimators(monkeypatch, tiny_model_path, tmp_path, estimator):
    adv = step_advantages(monkeypatch, tiny_model_path, tmp_path, f"{KEY}=normalize_then_sum",
                          f"algorithm.adv_estimator={estimator}")
    if estimator == "rloo":
        # rloo on GDPO's score s: G / (G - 1) (s - group mean), and each group's mean of s is 0
        torch.testing.assert_close(adv, 4 / 3 * GDPO)
    else:
        # s - group mean = s on each of the 3 response tokens, whitened over the 24 tokens (population
        # variance, eps 1e-8 inside the root): mean 0, variance 7/8 x unbiased variance 1 (up to E)
        var = (GDPO**2).mean()
        torch.testing.assert_close(adv, GDPO / torch.sqrt(var + 1e-8))
