"""The config check of algorithm.multi_objective_aggregation: each refusal names the key and its fix."""

from __future__ import annotations

import pytest
from test_validate import GAE, problems

KEY = "algorithm.multi_objective_aggregation"
GDPO = f"{KEY}=normalize_then_sum"
TWO = ["worker.reward.reward_function=null",
       "worker.reward.reward_functions=[{reward_function: a.py:f, weight: 1}, {reward_function: b.py:g, weight: 0.5}]"]
KL_LOSS = "algorithm.use_kl_loss=true"  # grpo with GDPO: the KL as a loss term


def messages(*overrides: str) -> list[str]:
    return [p.message for p in problems(*overrides) if p.key == KEY]


def test_default_and_valid_combinations_pass():
    assert problems(*TWO) == []  # sum_then_normalize with two functions: today's weighted sum
    assert problems(GDPO, *TWO, KL_LOSS) == []
    assert problems(GDPO, *TWO, "algorithm.disable_kl=true") == []
    # outcome estimators other than grpo take GDPO's score as theirs; the KL in the reward stays
    for estimator in ("rloo", "reinforce_plus_plus_baseline", "grpo_passk", "reinforce_plus_plus"):
        assert problems(GDPO, *TWO, f"algorithm.adv_estimator={estimator}") == [], estimator


@pytest.mark.parametrize("reward", [
    [],  # one worker.reward.reward_function
    ["worker.reward.reward_function=null", "worker.reward.reward_functions=[{reward_function: a.py:f}]"],
])
def test_fewer_than_two_reward_functions_are_refused(reward):
    (message,) = messages(GDPO, KL_LOSS, *reward)
    assert "the reward has 1 function(s)" in message and "two or more" in message
    assert "worker.reward.reward_functions" in message and f"{KEY}=sum_then_normalize" in message


@pytest.mark.parametrize("estimator, why", [("gae", "critic learns the values"), ("remax", "greedy response")])
def test_gae_and_remax_are_refused(estimator, why):
    overrides = GAE if estimator == "gae" else ["algorithm.adv_estimator=remax"]
    (message,) = messages(GDPO, *TWO, *overrides)
    assert f"algorithm.adv_estimator={estimator}" in message and why in message
    assert "grpo" in message and f"{KEY}=sum_then_normalize" in message


def test_grpo_with_the_kl_in_the_reward_is_refused():
    (message,) = messages(GDPO, *TWO)  # use_kl_loss=false, disable_kl=false: the default
    assert "KL penalty in the token rewards" in message
    assert "algorithm.use_kl_loss=true" in message and "algorithm.disable_kl=true" in message


def test_grpo_without_std_normalisation_is_refused():
    (message,) = messages(GDPO, *TWO, KL_LOSS, "algorithm.norm_adv_by_std_in_grpo=false")
    assert "norm_adv_by_std_in_grpo=false (Dr. GRPO) would do nothing" in message and "=true" in message


def test_an_unknown_value_is_refused_by_the_loader():
    with pytest.raises(Exception, match="multi_objective_aggregation"):
        problems(f"{KEY}=mean")
