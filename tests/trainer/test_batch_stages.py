"""The batch stages one by one (easyvlm.trainer.stages), on a hand-made step of 2 samples of one
prompt, with a stand-in for the trainer that holds only what each stage reads.

Samples: responses of 2 and 1 tokens (mask [[1, 1, 0], [1, 0, 0]]), overall rewards 1 and 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from easyvlm.algorithms.kl import FixedKLController
from easyvlm.algorithms.settings import KLSettings
from easyvlm.data.batch import Batch
from easyvlm.rewards.types import RewardResult
from easyvlm.trainer.stages import STAGES, StageContext, StepState

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def advantage_spec(**changes):
    spec = dict(estimator="grpo", gamma=1.0, lam=1.0, norm_by_std=True, kl=KLSettings(kl_penalty="kl"), critic_warmup=0,
                multi_objective_aggregation="sum_then_normalize", reward_weights=())
    return SimpleNamespace(**{**spec, **changes})


def trainer_with(**advantage) -> StageContext:
    return StageContext(advantage=advantage_spec(**advantage), kl_ctrl=FixedKLController(0.1))


def step_state(result: RewardResult | None = None) -> StepState:
    batch = Batch({"response_mask": MASK, "group_ids": torch.tensor([0, 0]),
                   "old_logprobs": torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]]),
                   "ref_logprobs": torch.tensor([[-1.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])})
    state = StepState(step=1, prompts=Batch({}), batch=batch, reward=None, metrics={}, result=result)
    state.scores = state.sequence_rewards = torch.tensor([1.0, 0.0])
    return state


def run(names, trainer, state):
    for name in names:
        STAGES[name](trainer)(state)


def test_token_rewards_kl_in_reward_and_grpo_advantages_by_hand():
    trainer, state = trainer_with(), step_state()
    run(["token_rewards", "kl_in_reward", "advantages"], trainer, state)
    # rewards on the last token: [[0, 1, 0], [0, 0, 0]]; k1 KL = old - ref = [[0.5, 0, 0], [0, 0, 0]];
    # minus 0.1 x KL: [[-0.05, 1, 0], [0, 0, 0]]. critic/kl: per-sequence means (0.25, 0), their mean 0.125
    assert torch.allclose(state.batch["token_rewards"], torch.tensor([[-0.05, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert state.metrics["critic/kl"] == pytest.approx(0.125) and state.metrics["critic/kl_coef"] == pytest.approx(0.1)
    # GRPO: scores 1 and 0 (the sequence rewards, not the KL-shaped tokens: outcome rewards), mean 0.5,
    # unbiased std sqrt(0.5): advantages +-0.5 / 0.70711 = +-0.70711 on every response token
    a = 0.5 / 0.5 ** 0.5
    assert torch.allclose(state.batch["advantages"], torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0]]), atol=1e-5)
    assert set(state.metrics) == {"critic/kl", "critic/kl_coef", "timing_s/adv"}  # all three timed as "adv"


def test_gigpo_reads_the_step_fields_and_logs_its_step_groups():
    # sample 0: two steps (tokens 0 and 1) from states 7 and 8, rewards 0.5 each; sample 1: one step
    # from state 7, reward 0. Sequence rewards 1 and 0 (as the grpo test above): episode +-a, a = 0.70711.
    # gamma 0.9: sample 0's step 0 returns 0.5 + 0.9 x 0.5 = 0.95, sample 1's 0 -> step group 7 {0.95, 0}:
    # deviations +-0.475, unbiased std 0.475 sqrt(2) -> +-a; step group 8 {0.5} alone -> 0
    trainer, state = trainer_with(estimator="gigpo", gamma=0.9), step_state()
    state.batch["turn_index"] = torch.tensor([[0, 1, -1], [0, -1, -1]])
    state.batch["step_rewards"] = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    state.batch["step_anchors"] = torch.tensor([[7, 8], [7, 0]])
    run(["token_rewards", "advantages"], trainer, state)
    a = 0.5 / 0.5 ** 0.5
    assert torch.allclose(state.batch["advantages"], torch.tensor([[2 * a, a, 0.0], [-2 * a, 0.0, 0.0]]), atol=1e-5)
    # step groups 7 (2 steps) and 8 (1): mean 1.5, max 2; 2 of the 3 steps share a group
    assert {k: v for k, v in state.metrics.items() if k.startswith("gigpo/")} == pytest.approx(
        {"gigpo/step_group_size_mean": 1.5, "gigpo/step_group_size_max": 2.0, "gigpo/grouped_step_fraction": 2 / 3})


def test_multi_objective_replaces_the_sequence_rewards_with_gdpo_scores():
    from easyvlm.algorithms.multi_objective import gdpo_scores

    result = RewardResult({"overall": [1.0, 0.0], "a/overall": [1.0, 0.0], "b/overall": [0.0, 1.0]}, {}, [],
                          ["a/overall", "b/overall"])
    trainer, state = trainer_with(reward_weights=(1.0, 0.5)), step_state(result)
    run(["multi_objective"], trainer, state)
    per_function = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # (B, K): function a's then b's score per sample
    assert torch.equal(state.sequence_rewards, gdpo_scores(per_function, (1.0, 0.5), torch.tensor([0, 0])))
    assert torch.equal(state.scores, torch.tensor([1.0, 0.0]))  # the logged score stays the overall reward


def test_the_actor_waits_for_the_critic_warmup():
    calls = []
    hybrid = SimpleNamespace(dispatch_collect=lambda *args, **kwargs: calls.append(args) or [{"actor/pg_loss": 0.5}])
    trainer = StageContext(advantage=advantage_spec(critic_warmup=1), workers=SimpleNamespace(hybrid=hybrid))
    stage, state = STAGES["update_actor"](trainer), step_state()
    stage(state)  # step 1 <= critic_warmup: no update
    assert calls == []
    state.step = 2
    stage(state)
    assert [c[0] for c in calls] == ["update_actor"]
    assert state.metrics["actor/pg_loss"] == 0.5 and "timing_s/update_actor" in state.metrics
